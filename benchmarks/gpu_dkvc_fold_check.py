"""Exit 0 when, in a junit XML of tests/test_delta_attention.py's GPU cases, the mean-anchor cases
(anchor_len 1: the folded path) failed while the 256-row anchor cases (the rebuild path) passed; else 1.
benchmarks/gpu_dkvc_session.sh then runs the later steps with STRATUM_DKVC_FOLD_MEAN_ANCHOR=0 (a mean
anchor through the rebuild path).

    python benchmarks/gpu_dkvc_fold_check.py OUT/a_gpu_tests.xml
"""
import re
import sys
import xml.etree.ElementTree as ET


def fold_failed_rebuild_passed(path: str) -> bool:
    """Test ids look like test_kernel_compiled_on_gpu[config0-1-dtype0]: config, anchor_len, dtype."""
    outcome: dict[str, list[bool]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        m = re.fullmatch(r"test_kernel_compiled_on_gpu\[config\d+-(\d+)-dtype\d+\]", case.get("name", ""))
        if m and case.find("skipped") is None:
            failed = case.find("failure") is not None or case.find("error") is not None
            outcome.setdefault(m.group(1), []).append(failed)
    return any(outcome.get("1", [])) and bool(outcome.get("256")) and not any(outcome["256"])


if __name__ == "__main__":
    try:
        sys.exit(0 if fold_failed_rebuild_passed(sys.argv[1]) else 1)
    except (OSError, ET.ParseError) as e:
        print(f"no usable junit XML ({e}): the folded mean-anchor path stays on", file=sys.stderr)
        sys.exit(1)
