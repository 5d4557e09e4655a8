"""The three ledgers (memory, bandwidth, schedule) as pure arithmetic over shapes and bytes.

No tensors live here: the planner and the runtime (engine KV sizing, trainer offload choices)
call the same functions, so a prediction is testable against a measurement.
"""
