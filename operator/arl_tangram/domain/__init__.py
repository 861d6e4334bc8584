"""The domain the operator works in, translated once from the API models (pure: no I/O).

``arl_tangram.api`` is what users write; everything the scheduler, the managers, the planner, the
runtime, the gateway and the simulator need is derived here from those models, so that a default or
a limit is stated once (in the API model) and read everywhere else.
"""
