"""Config loading, overrides and validation errors."""

import re

import pytest

from fedseg.algorithms import get_algorithm, known_sections
from fedseg.algorithms.fedprox import FedProxParams
from fedseg.algorithms.fedsm import FedSMParams
from fedseg.foundation.config import RunConfig, TrainConfig, dump_toml, load_run_config
from fedseg.foundation.errors import ConfigError


def _write(tmp_path, text, name="run.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_overrides_and_roundtrip(tmp_path):
    p = _write(tmp_path, 'federation = "fed.toml"\nmethod = "fedavg"\n[train]\nlr = 0.01\n')
    cfg = load_run_config(p, ["train.batch_size=2", "rounds=5", "fedavg.weighting=even"], known_sections())
    assert cfg.train.lr == 0.01 and cfg.train.batch_size == 2 and cfg.rounds == 5
    assert cfg.federation == str((tmp_path / "fed.toml").resolve())
    assert cfg.params["fedavg"] == {"weighting": "even"}
    assert cfg.model.channels is None and cfg.model.levels()[0] == (16, 32, 64, 128, 256)
    # the resolved config written beside results loads back to the same config
    again = load_run_config(
        _write(tmp_path, dump_toml(cfg.to_dict()), "resolved.toml"), known_sections=known_sections()
    )
    assert again == cfg


def test_federation_spec_is_accepted_as_config(tmp_path):
    p = _write(tmp_path, '[[sites]]\nname = "a"\ndatalist = "a.json"\n', "federation.toml")
    assert load_run_config(p).federation == str(p.resolve())


@pytest.mark.parametrize(
    "text, overrides, match",
    [
        ('federation = "f"\n[train]\nlr_rate = 1\n', [], r"\[train\] has unknown key\(s\) \['lr_rate'\]"),
        ('federation = "f"\n', ["train.batch_size=abc"], "train.batch_size: expected an integer"),
        (
            'federation = "f"\n',
            ["train.local_steps=10", "train.local_epochs=2"],
            "exactly one of train.local_epochs and train.local_steps",
        ),
        (
            'federation = "f"\n[train]\nlocal_steps = 10\nlocal_epochs = 2\n',
            [],
            "exactly one of train.local_epochs and train.local_steps",
        ),
        ('federation = "f"\n', ["model.strides=[2]"], "one stride fewer than channels"),
        ('federation = "f"\n', ["nonsense"], "not of the form key=value"),
        ('federation = "f"\nfoo = 1\n', [], "unknown config key 'foo'"),
        ('method = "fedavg"\n', [], "names no federation"),
        ('federation = "f"\n[train\n', [], "not valid TOML"),
    ],
)
def test_bad_configs_get_one_clear_error(tmp_path, text, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(_write(tmp_path, text), overrides, known_sections())


@pytest.mark.parametrize(
    "text, overrides, epochs, steps",
    [
        ("", ["train.local_steps=60"], None, 60),  # replaces the default epochs
        ("[train]\nlocal_epochs = 2\n", ["train.local_steps=60"], None, 60),  # replaces the file's epochs
        ('[train]\nlocal_steps = 20\nlocal_epochs = "none"\n', ["train.local_epochs=3"], 3.0, None),
        ('[train]\nlocal_steps = 20\nlocal_epochs = "none"\n', [], None, 20),  # the file's own choice
        ("", ["train.local_steps=60", "train.local_epochs=none"], None, 60),  # the old spelling still works
        ('[train]\nlocal_steps = 20\nlocal_epochs = "none"\n', ["train.lr=0.1"], None, 20),  # other keys: no effect
    ],
)
def test_overriding_one_of_two_exclusive_settings_replaces_the_other(tmp_path, text, overrides, epochs, steps):
    cfg = load_run_config(_write(tmp_path, 'federation = "f"\n' + text), overrides, known_sections())
    assert (cfg.train.local_epochs, cfg.train.local_steps) == (epochs, steps)


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config("/nonexistent/run.toml")


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.precision=fp8",
            "train.precision = 'fp8'; use 'fp32', 'bf16' or 'fp16' (e.g. --set train.precision=fp32)",
        ),
        ("train.precision=16", "train.precision = 16; use 'fp32', 'bf16' or 'fp16'"),
        ("model.norm=layer", "model.norm = 'layer'; use 'instance', 'batch' or 'none'"),
        ("eval.best_criterion=median", "eval.best_criterion = 'median'; use 'cases' or 'sites'"),
        ("simulation.vectorize=yes", "simulation.vectorize = 'yes'; use 'auto', 'on' or 'off'"),
        (
            "fedavg.weighting=median",
            "fedavg.weighting = 'median'; use 'samples' or 'even' (e.g. --set fedavg.weighting=samples)",
        ),
        ("fedavg.aggregation=avg", "fedavg.aggregation = 'avg'; use 'mean', 'trimmed_mean' or 'median'"),
        ("volume_reads=disk", "volume_reads = 'disk'; use 'auto', 'memory' or 'cache' (e.g. --set volume_reads=auto)"),
    ],
)
def test_a_word_outside_its_literal_is_refused_naming_the_key_and_the_allowed_words(tmp_path, override, message):
    """Options typed ``Literal[...]`` are checked by the loader, for run settings and methods' ``Params`` alike."""
    path = _write(tmp_path, 'federation = "f"\nmethod = "fedavg"\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_algorithm(load_run_config(path, [override], known_sections()))


def test_a_config_built_in_python_gets_the_loaders_message():
    """Sections and top-level settings built in Python are checked as the loader checks them, and a method's
    settings that extend FedAvg's (FedProx, FedSM) name their own section in the checks they inherit."""
    with pytest.raises(ConfigError, match=re.escape("train.loss = 'l1'; use 'auto', 'dice', 'dicece' or 'bce'")):
        TrainConfig(loss="l1").validate()
    TrainConfig(loss="dicece", precision="bf16", data="stream").validate()
    with pytest.raises(ConfigError, match="^" + re.escape("volume_reads = 'disk'; use 'auto', 'memory' or 'cache'")):
        RunConfig(federation="f", volume_reads="disk").validate()  # type: ignore[arg-type]
    for params, section in ((FedProxParams, "fedprox"), (FedSMParams, "fedsm")):
        with pytest.raises(ConfigError, match=rf"^{section}\.trim"):
            params(aggregation="trimmed_mean", trim=0.7).validate()


def test_none_is_a_choice_where_a_setting_names_it_and_unset_elsewhere(tmp_path):
    """``"none"`` stands for an unset value (None, filled in by a profile or a default) — except where the
    setting's own choices include the word: ``fedsm.selector_augment = "none"`` (no flips) must stay "none"
    under the default profile, whose unset value is ``"flip"``; ``fedsm.selector_lr = none`` is unset."""
    path = _write(tmp_path, 'federation = "f"\nmethod = "fedsm"\n')
    params = get_algorithm(
        load_run_config(path, ["fedsm.selector_augment=none", "fedsm.selector_lr=none"], known_sections())
    ).params
    assert params.selector_augment == "none" and params.selector_lr is None
    assert get_algorithm(load_run_config(path, [], known_sections())).params.selector_augment == "flip"
    # written resolved and read back, the choice survives
    cfg = load_run_config(path, ["fedsm.selector_augment=none"], known_sections())
    again = load_run_config(
        _write(tmp_path, dump_toml(cfg.to_dict()), "resolved.toml"), known_sections=known_sections()
    )
    assert get_algorithm(again).params.selector_augment == "none"


def test_auto_loss_is_dice_on_images_and_dice_ce_on_volumes():
    """train.loss = "auto": the papers' Dice on 2D images, Dice + cross-entropy on volumes (nnU-Net's);
    an explicit loss is kept either way."""
    assert TrainConfig().loss == "auto"
    assert TrainConfig().loss_for(volumes=False) == "dice"
    assert TrainConfig().loss_for(volumes=True) == "dicece"
    assert TrainConfig(loss="dice").loss_for(volumes=True) == "dice"
    assert TrainConfig(loss="bce").loss_for(volumes=False) == "bce"
