"""PruneTrain's wing: Table 1 (``prunetrain_table1``) and its pages, the speed of reconfigured
models (``prunetrain_speed``) and the compile cost of a reconfiguration
(``prunetrain_compile_bench``)."""
