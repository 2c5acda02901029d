"""%%distributed: a cell runs on every rank with the notebook's names, results kept afterwards."""
import pytest
from IPython.core.interactiveshell import InteractiveShell

import utils


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "utils")
    shell.run_cell("import torch, torch.distributed as dist\noffset = 100\n"
                   "def double(x):\n    return 2 * x\n")
    return shell


def test_cell_runs_on_every_rank_with_notebook_names(shell, capfd):
    cell = ("t = torch.ones(2) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(t)\n"
            "print('rank', dist.get_rank(), 'sum', t[0].item())\n"
            "double(t[0].item()) + offset\n")
    returned = shell.run_cell_magic("distributed", "-n 3", cell)
    assert returned == [112.0, 112.0, 112.0]
    assert shell.user_ns["distributed_results"] == returned
    out = capfd.readouterr().out.splitlines()
    assert out == [f"[rank {r}] rank {r} sum 6.0" for r in range(3)]


def test_cell_without_final_expression_returns_nothing_and_custom_name(shell):
    assert shell.run_cell_magic("distributed", "-n 2 -o ranks", "r = dist.get_rank()") is None
    assert shell.user_ns["ranks"] == [None, None]


def test_failure_in_cell_shows_the_cell_line(shell):
    with pytest.raises(utils.LaunchError) as err:
        shell.run_cell_magic("distributed", "-n 2", "x = 1\nif dist.get_rank() == 1:\n    raise KeyError('lost')\n")
    message = str(err.value)
    assert message.startswith("rank 1 failed with KeyError")
    assert "raise KeyError('lost')" in message and '"<distributed cell>", line 3' in message


def test_names_used_sees_inside_functions():
    from utils.magic import names_used
    assert {"helper", "data"} <= names_used("def f():\n    return helper(data)\n")
