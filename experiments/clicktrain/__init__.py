"""ClickTrain's wing: Table 1 (``clicktrain_table1``), its aligned-mode page, and the benches
of its pruned stage (``pattern_conv_bench``, ``aligned_bench``, ``clicktrain_overhead``)."""
