"""Per-family device pools. Each places one adapter's weights in a slot, all or
nothing, and clears a slot; none allocates after construction."""
