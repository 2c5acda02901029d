"""Notebook tests (nbval: `make test`, or the strict nbval of one notebook) give each notebook's kernel a
temporary folder of this test session's own, removed when the session ends.

nbval stops a kernel by killing its whole process group, and the multiprocessing forkserver a lesson starts
(utils/forkserver.py) is in that group: neither runs its exit cleanup, so what they made in the temporary folder
(multiprocessing's pymp-*/listener-*, torch's tmp*/_remote_module_non_scriptable.py) stayed in /tmp, one pymp-*
folder per notebook. Only the kernels' TMPDIR changes: it is set while nbval starts a notebook's kernel (the
kernel inherits it) and put back at once, so the tests' own processes keep theirs. Each session (each of make
test's workers) has its own folder, made when its first notebook starts. (Kernels that utils/tools/run.py and
the grader start get theirs from utils/tools/kernels.py.) It lives here, at the root, because pytest reads a
conftest.py only beside or above the paths it is given: here for `pytest lessons/...` as for `make test`.
"""
import os
import shutil
import tempfile

import pytest

_ATTRIBUTE = "_course_kernel_temp_folder"


def kernel_temp_folder(config) -> str:
    """This session's folder for its notebook kernels' temporary files (made on first use)."""
    folder = getattr(config, _ATTRIBUTE, None)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="nbk-")  # short: multiprocessing puts Unix sockets two levels below
        setattr(config, _ATTRIBUTE, folder)
    return folder


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    """A notebook's first cell's setup starts its kernel (nbval's IPyNbFile.setup): with TMPDIR the session's."""
    if type(item).__module__ != "nbval.plugin":
        return (yield)
    saved = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = kernel_temp_folder(item.config)
    try:
        return (yield)
    finally:
        if saved is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved


def pytest_unconfigure(config):
    """After every notebook's kernel was stopped (each notebook's teardown): remove what they left."""
    folder = getattr(config, _ATTRIBUTE, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
