"""Exit 0 when, in a junit XML of tests/test_delta_attention.py's GPU cases, the mean-anchor cases
(register-resident anchor, anchor_len 1) failed while the 256-row anchor-ring cases passed; else 1.
benchmarks/gpu_dkvc_session.sh then runs the later steps with STRATUM_DKVC_RESIDENT_ANCHOR=0.

    python benchmarks/gpu_dkvc_resident_check.py OUT/a_gpu_tests.xml
"""
import re
import sys
import xml.etree.ElementTree as ET


def resident_failed_ring_passed(path: str) -> bool:
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
        sys.exit(0 if resident_failed_ring_passed(sys.argv[1]) else 1)
    except (OSError, ET.ParseError) as e:
        print(f"no usable junit XML ({e}): the resident anchor stays on", file=sys.stderr)
        sys.exit(1)
