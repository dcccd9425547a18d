"""What the Mosaic GPU interpreter cannot run reliably: a cluster barrier of several blocks.

jax 0.11.2's interpreter deadlocks now and then on a cluster barrier of several blocks (measured on this 2-core
machine: 3-5 of 8 runs of a cluster of 2-8 hung, with XLA's async CPU dispatch on or off; every hung thread waits in
the interpreter's ClusterBarrier.wait or in XLA's Execute; session 36 saw a CI run hang the same way in the split
merge's test after four passing runs by hand). A test that hangs by luck cannot run in CI, so such cases stay in the
files, skipped, for the day the interpreter schedules clusters safely; the cluster kernels are checked by lowering
for CUDA and on the GPU by gpu-marked tests."""
import pytest

CLUSTER_HANGS = pytest.mark.skip(reason="the GPU interpreter deadlocks intermittently on multi-block cluster barriers")
