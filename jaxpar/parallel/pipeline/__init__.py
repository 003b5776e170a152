"""Pipeline parallelism: :mod:`.schedules` (schedules as tables of rounds), :mod:`.program`
(compiled to what each round reads and writes), :mod:`.stages` (the model cut into chunks, the
vocabulary into pieces), :mod:`.executor` (one SPMD ``shard_map`` running any schedule)."""
