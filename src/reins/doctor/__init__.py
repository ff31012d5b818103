"""`reins doctor`: check that a harness can be trained through reins, before any training.

report    build_report: recorded calls of N runs -> figures and findings (pure)
received  what a harness received from a call, and whether the tokens say it (pure)
fixes     the setting or change that addresses each finding (text)
render    the report as a plain-text table
runner    run_doctor: a private gateway and engine, the harness run N times (processes)
"""

from reins.doctor.render import render_text
from reins.doctor.report import (
    Detokenizer,
    DoctorReport,
    Finding,
    HarnessRun,
    SplitExample,
    build_report,
)

__all__ = [
    "Detokenizer",
    "DoctorReport",
    "Finding",
    "HarnessRun",
    "SplitExample",
    "build_report",
    "render_text",
]
