"""The three ledgers (memory, bandwidth, schedule) as pure arithmetic over shapes and bytes.

No tensors live here: the planner and the runtime (engine KV sizing, trainer offload choices)
call the same functions, so a prediction is testable against a measurement.

Modules: ``models`` (shapes from config.json, known names, bare counts), ``kv`` (the KV
formula the engine shares), ``memory`` (per-parameter bills, activations),
``bill`` (per-device terms by role and phase, ``predict_peak``), ``runtime`` (one orbitrl
run's ``RunSpec`` from its Config, its prediction and KV pool), ``bandwidth`` and ``timing`` (bytes moved and
their exposed seconds), ``schedule`` (the step simulator), ``execution`` (per-role placement),
``plan`` (fit, fewest devices, proposals) and ``report`` (tables). Units: bytes and seconds;
GB is 1e9 bytes.
"""
