"""Benchmarks of megatron_muon against its peers, and the scale model for real clusters.

Every script here runs on the CPU (gloo ranks, small sizes, ``--quick``) and on a GPU box
(CUDA picked automatically; real sizes without ``--quick``). Each prints its table and
writes ``<name>.json`` and ``<name>.md`` into ``--out`` (default ``docs/bench``);
``run_all.py`` runs them all and regenerates ``docs/benchmarks.md``.

Scripts: ``optimizer_step`` (peers side by side on one model), ``newton_schulz`` (kernel
throughput), ``overlap_trace`` (timeline of one MoE step), ``scale_model`` (bytes, FLOPs
and time for real models on real clusters), ``plots`` (PNG charts), ``config_reference``
(the MuonConfig table of ``docs/usage.md``), ``run_all``.
"""
