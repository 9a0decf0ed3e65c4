"""The plan layer: the Plan and its sections, the one builder, and planning a request.

`model` holds the frozen `Plan` and its file form, `sections` its typed sections,
`build` derives a plan from a search's decision, `planning` runs the searches and keeps
the fastest plan that fits. Readers (validate, explain, exports, the executor) import
`model` and `sections` only.
"""
