"""Each parallelism that needs code of its own: :mod:`.rules` (the logical-to-mesh axis table),
:mod:`.zero` (ZeRO-1/3), :mod:`.context` (ring and all-gather attention), :mod:`.expert` (MoE
all-to-alls), :mod:`.pipeline` (the schedules and their executor), :mod:`.manual` (axes split by
hand, gradients summed once per step), :mod:`.hooks` (installing them into the model)."""
