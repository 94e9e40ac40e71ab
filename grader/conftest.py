"""Grader set-up. Order matters: the Triton interpreter must be chosen before triton is imported."""

from yaie.device import prepare_triton

prepare_triton()

from grader.framework import (  # noqa: E402,F401  (the plugin's hooks and fixtures)
    device, pytest_addoption, pytest_collection_finish, pytest_collection_modifyitems, pytest_configure,
    pytest_report_teststatus, pytest_runtest_call, pytest_runtest_logreport, pytest_runtest_makereport,
    pytest_terminal_summary, seed,
)
