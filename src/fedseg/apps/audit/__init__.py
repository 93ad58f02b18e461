"""The leakage audit (``fedseg audit``): a gradient-inversion attack (Geiping et al. 2020) from the
server's point of view against what each method sends — an FGA step, FedSM's selector step, a FedAvg
update — as the server observes it in plain, under secure aggregation and under differential privacy,
scored with PSNR and SSIM against the sites' images.  See ``docs/privacy.md``."""

from fedseg.apps.audit.inversion import AttackConfig, Inversion, Part, fc_inversion, invert, total_variation
from fedseg.apps.audit.messages import MESSAGES, METHOD_MESSAGES, Sent, private_messages, sent_by_sites
from fedseg.apps.audit.metrics import match_scores, psnr, ssim
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
    "AttackConfig",
    "AuditOptions",
    "AuditRow",
    "Inversion",
    "Part",
    "Sent",
    "audit_federation",
    "audit_table",
    "fc_inversion",
    "invert",
    "match_scores",
    "messages_for",
    "private_messages",
    "psnr",
    "run_audit",
    "secure_sum",
    "sent_by_sites",
    "ssim",
    "total_variation",
    "write_audit",
]
