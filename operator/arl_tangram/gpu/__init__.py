"""GPUs of a node: the NVML inventory (real or fake), MIG tables and layouts, the node agent, the GPU check.

Importing this package imports nothing but the standard library: ``inventory``, ``mig``, ``fake``
and ``nvml`` (which loads nvidia-ml-py only when called) are what the GPU check runs with.
"""
