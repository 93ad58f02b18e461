"""The example report in a real browser: headless Chromium (Debian's ``chromium`` package) loads
``docs/example-report.html`` with a small checker script added, and the test fails on any console
message (the report itself has no script, so any message is an error) or an image that does not decode.

Runs only where Chromium is installed (``apt-get install chromium``); skipped elsewhere.
The commands are those of ``docs/report.md`` ("Checking the report in a browser").
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "docs" / "example-report.html"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed (apt-get install chromium)")

#: Added before </body>: on load, every image must have decoded; the result goes into the DOM.
CHECKER = (
    '<script>window.addEventListener("load",function(){var im=document.images,bad=0;'
    'for(var i=0;i<im.length;i++){if(!im[i].complete||im[i].naturalWidth===0){bad++;console.error("broken image "+i);}}'
    'document.body.setAttribute("data-check","images="+im.length+" broken="+bad);});</script>'
)
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def render(html_file: Path, profile: Path) -> tuple[list[str], str]:
    """(console messages, DOM after load) of ``html_file`` with the checker added, in a fresh Chromium profile."""
    page = profile.parent / (html_file.stem + "-checked.html")
    page.write_text(html_file.read_text(encoding="utf-8").replace("</body>", CHECKER + "</body>"), encoding="utf-8")
    profile.mkdir()
    cmd = [
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
        "--dump-dom",
        page.as_uri(),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    console = [line for line in proc.stderr.splitlines() if re.search(r":CONSOLE(:\d+)?\]", line)]
    return console, proc.stdout


def test_example_report_renders_without_console_errors(tmp_path):
    # Execute
    console, dom = render(EXAMPLE, tmp_path / "profile")
    # Assert: the checker ran, every figure decoded, nothing on the console
    m = re.search(r'data-check="images=(\d+) broken=(\d+)"', dom)
    assert m is not None, "the page did not finish loading (no checker result in the DOM)"
    assert int(m.group(1)) >= 5 and m.group(2) == "0"
    assert console == []
    for sec in ("headline", "fedsm", "distributions", "curves", "predictions", "config"):
        assert f'id="{sec}"' in dom


def test_the_check_detects_a_script_error_and_a_broken_image(tmp_path):
    """The same check on a copy with an injected JS error and one corrupted figure fails on both."""
    # Prepare
    text = EXAMPLE.read_text(encoding="utf-8")
    text = text.replace("data:image/png;base64,iVBOR", "data:image/png;base64,XXXXX", 1)
    text = text.replace("</body>", "<script>notAFunction();</script></body>")
    bad = tmp_path / "bad.html"
    bad.write_text(text, encoding="utf-8")
    # Execute
    console, dom = render(bad, tmp_path / "profile")
    # Assert
    assert any("notAFunction is not defined" in line for line in console)
    assert any("broken image" in line for line in console)
    assert re.search(r'data-check="images=\d+ broken=1"', dom)
