"""The Triton interpreter's set-up for the kernel tests (tools/triton_interpreter.py). Import it
before anything imports triton: without CUDA it sets TRITON_INTERPRET=1."""
from tools.triton_interpreter import DEVICE, INTERPRETED, faster_interpreter, gpu_faithful  # noqa: F401
