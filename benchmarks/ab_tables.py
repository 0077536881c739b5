"""For the one-process A/B benchmarks (vd_ab.py, iq3_prefill_ab.py): memfit.quant.tables
installs the IQ lattice tables once per process, into memfit._native only, so a second build
loaded beside it (the base) gets them here too."""


def install_iq_tables(*natives) -> None:
    from memfit.quant import tables
    for mod in natives:
        for g in tables._GRIDS:
            mod.set_quant_table(g, tables.grid(g))
        mod.set_quant_table("ksigns", tables.ksigns())
