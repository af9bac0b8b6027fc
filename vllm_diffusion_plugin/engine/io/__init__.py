"""Reading: checkpoints into tensors, and nothing of the rest of the engine.

The entries: ``checkpoint.resolve_checkpoint`` (which files and tensors a component has, headers only),
``stream.iterate_weights`` (a component's tensors, in order, bytes counted), ``rows.read_bound_rows`` (this rank's
rows straight into its shards), ``staging.DeviceStaging`` (onto an accelerator through pinned memory),
``integrity`` (files that change under a load). Below them: ``threads`` (read threads, bounded waits),
``pagein`` (page-in and ``pread``, a failing store named), ``headers``.
"""
