"""`qwen-triton ops`: every operator row exists and names kernels that exist."""

import importlib

from qwen_triton.cli import main
from qwen_triton.operators.table import OPERATORS, kernels


def test_every_row_of_the_issue_is_present():
    covered = set()
    for op in OPERATORS:
        for part in op.rows.split(","):
            first, _, last = part.strip().partition("-")
            covered.update(range(int(first), int(last or first) + 1))
    assert covered == set(range(1, 28))


def test_every_named_kernel_exists():
    for entry in kernels():
        module, name = entry.split(":")
        kernel = getattr(importlib.import_module(f"qwen_triton.operators.{module}"), name)
        assert callable(kernel) or hasattr(kernel, "fn"), entry


def test_ops_command_prints_the_table(capsys):
    assert main(["ops"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("\n") >= len(OPERATORS) + 1
    assert "_decode_split_kernel" in printed and "_chunk_state_kernel" in printed
