"""The cost layer of the planner: what ops, moves and steps cost on a hardware profile.

`pricing` prices one op, one collective, one edge and the optimizer pass; `units` adds
an op-level plan's prices up per unit (layer); `weights` says what each weight's
synchronisation issues under each ZeRO stage; `pipeline` prices the devices of a pipeline;
`step` is the one step model every plan's prediction comes from. The formulas of the
hardware itself (roofline, collectives, memory, schedules) are in `costmodels`.
"""
