"""The ``hsdp_weight_load`` strategies: how the ranks of an HSDP job get their weights."""
