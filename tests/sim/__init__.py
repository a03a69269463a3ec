"""SIMULATED vendor libraries for tests: a fake HIP runtime and a fake ACL runtime written in
Python over real host memory.  They stand in for libamdhip64.so / libascendcl.so so the ROCm
and Ascend bindings can be unit-tested here; they are not hardware and prove nothing about it."""
