"""Dice per case and site, Table 3 summaries, multi-seed aggregation and Markdown tables."""

from fedseg.evaluation.summary import row_from_cases, summarize
from fedseg.evaluation.tables import method_rows, table3

__all__ = ["method_rows", "row_from_cases", "summarize", "table3"]
