"""The leakage audit (``fedseg audit``): a gradient-inversion attack (Geiping et al. 2020) from the
server's point of view against what each method sends — an FGA step, FedSM's selector step, a FedAvg
update — as the server observes it in plain, under secure aggregation and under differential privacy,
scored with PSNR and SSIM against the sites' images and their mean image, with re-identification among the
sites' images and a verdict that needs both.  See ``docs/privacy.md``."""

from fedseg.apps.audit.inversion import (
    REFERENCE_ATTACK,
    AttackConfig,
    Inversion,
    LocalOptimizer,
    Part,
    Update,
    fc_inversion,
    invert,
    total_variation,
    unrolled_update,
)
from fedseg.apps.audit.messages import (
    MESSAGES,
    METHOD_MESSAGES,
    Sent,
    known_seed_message,
    private_messages,
    sent_by_sites,
    server_isolated,
)
from fedseg.apps.audit.metrics import VERDICTS, match_scores, ncc, psnr, reidentification, ssim, verdict
from fedseg.apps.audit.observe import PROTECTIONS, secure_sum
from fedseg.apps.audit.run import (
    AuditOptions,
    AuditRow,
    audit_federation,
    audit_table,
    messages_for,
    run_audit,
    write_audit,
)

__all__ = [
    "MESSAGES",
    "METHOD_MESSAGES",
    "PROTECTIONS",
    "REFERENCE_ATTACK",
    "VERDICTS",
    "AttackConfig",
    "AuditOptions",
    "AuditRow",
    "Inversion",
    "LocalOptimizer",
    "Part",
    "Sent",
    "Update",
    "audit_federation",
    "audit_table",
    "fc_inversion",
    "invert",
    "known_seed_message",
    "match_scores",
    "messages_for",
    "ncc",
    "private_messages",
    "psnr",
    "reidentification",
    "run_audit",
    "secure_sum",
    "sent_by_sites",
    "server_isolated",
    "ssim",
    "total_variation",
    "unrolled_update",
    "verdict",
    "write_audit",
]
