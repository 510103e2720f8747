"""Every kernel: Triton kernels for CUDA and the native C kernels for x86 CPUs, grouped by op
(attention, gemv, rope, norm, activation, argmax, allreduce, cpu), each op with the plain-torch
reference it is tested against beside it (`reference.py`). No nn.Module lives here and nothing here
imports layers, models, worker or engine: the layers above choose which kernel runs.
"""
