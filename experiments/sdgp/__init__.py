"""SDGP's wing: Table I (``sdgp_table1``), Figure 8 (``sdgp_fig8``) and the time model
(``sdgp_timemodel``)."""
