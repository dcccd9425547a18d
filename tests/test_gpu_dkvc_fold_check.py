"""benchmarks/gpu_dkvc_fold_check.py: the GPU session sends the mean anchor through the rebuild path only
when the folded (mean-anchor) cases failed and the rebuild (256-row anchor) cases passed."""
import importlib.util
from pathlib import Path

import pytest

# Loaded from its file: putting benchmarks/ on sys.path would shadow the `serving` package with
# benchmarks/serving.py for every test after this one.
_spec = importlib.util.spec_from_file_location(
    "gpu_dkvc_fold_check", Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_dkvc_fold_check.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
fold_failed_rebuild_passed = _module.fold_failed_rebuild_passed


def _xml(tmp_path, outcomes):
    """outcomes: {test id: "pass" | "fail" | "error" | "skip"} -> a junit XML file as pytest writes it."""
    body = {"pass": "", "fail": "<failure message='x'/>", "error": "<error message='x'/>", "skip": "<skipped/>"}
    cases = "".join(f"<testcase classname='tests.test_delta_attention' name='{name}'>{body[o]}</testcase>"
                    for name, o in outcomes.items())
    path = tmp_path / "a.xml"
    path.write_text(f"<testsuites><testsuite name='pytest'>{cases}</testsuite></testsuites>")
    return str(path)


@pytest.mark.parametrize("mean, ring, switch", [
    ("fail", "pass", True), ("error", "pass", True), ("pass", "pass", False), ("fail", "fail", False),
    ("skip", "skip", False), ("pass", "fail", False)])
def test_switch_only_when_the_folded_path_alone_failed(tmp_path, mean, ring, switch):
    outcomes = {"test_kernel_compiled_on_gpu[config0-1-dtype0]": mean,
                "test_kernel_compiled_on_gpu[config0-1-dtype1]": "pass",
                "test_kernel_compiled_on_gpu[config0-256-dtype0]": ring,
                "test_kernel_compiled_on_gpu[config0-256-dtype1]": "pass",
                "test_entry_point_errors": "fail"}            # not a GPU compile case: ignored
    assert fold_failed_rebuild_passed(_xml(tmp_path, outcomes)) is switch
