"""Pipeline parallelism: :mod:`.schedules` (GPipe, 1F1B, interleaved, zero-bubble as tables of
steps), :mod:`.program` (a schedule compiled to what each step reads and writes), :mod:`.stages`
(the model cut into chunks, the vocabulary into pieces) and :mod:`.executor` (one SPMD
``shard_map`` that runs any schedule)."""
