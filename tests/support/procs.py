"""The services as processes, for end-to-end tests: tools/launch.py, which the soak and the
benchmarks use too."""
from tools.launch import (REPO, Proc, Services, free_port, running_services, scheduler_proc,  # noqa: F401
                          tensor_parallel_args, wait_serving, worker_proc)
