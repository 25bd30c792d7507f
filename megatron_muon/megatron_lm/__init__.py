"""megatron_muon inside Megatron-LM's own training (``megatron.training``, shipped in the
megatron-core wheel): only what Megatron-LM lacks.

* ``launch``      - our layers on Megatron-LM's launch for ``tools/pretrain_gpt.py`` (which has
  Megatron-LM's ``pretrain_gpt.py`` shape) and the ``megatron-muon-pretrain`` console script;
* ``integration`` - ``use_megatron_muon()``: ``--optimizer muon`` in Megatron-LM's training;
* ``muon_args``   - the ``--muon-*`` flags, generated from :class:`megatron_muon.MuonConfig`;
* ``recipes``     - ``--recipe``: YAML files of Megatron-LM flags;
* ``corpus``      - the built-in byte corpus and the data checks Megatron-LM lacks;
* ``cpu``         - the patches Megatron-LM's training code needs without a GPU.
"""
