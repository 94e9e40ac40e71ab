"""The course's own tests. The Triton interpreter must be chosen before anything imports triton."""

from yaie.device import prepare_triton

prepare_triton()
