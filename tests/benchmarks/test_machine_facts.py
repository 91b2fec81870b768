"""What benchmarks record of the machine (benchmarks/machine.py)."""

from __future__ import annotations

from benchmarks.machine import cpu_model

FIRST = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n" \
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n"


def test_a_cpu_is_named_with_its_family_and_model(tmp_path):
    """Two CPUs a VM names alike ("AMD EPYC", Zen 3 and Zen 5) are told apart, by the first
    processor's fields; a cpuinfo without the numbers gives the bare name."""
    names = []
    for family, model in (("25", "1"), ("26", "2")):
        cpuinfo = tmp_path / f"cpuinfo_{family}"
        second = FIRST.format(family=99, model=99).replace("processor\t: 0", "processor\t: 1")
        cpuinfo.write_text(FIRST.format(family=family, model=model) + "\n" + second)
        names.append(cpu_model(cpuinfo))
    assert names == ["AMD EPYC (family 25 model 1)", "AMD EPYC (family 26 model 2)"]
    bare = tmp_path / "bare"
    bare.write_text("processor\t: 0\nmodel name\t: Some CPU\n")
    assert cpu_model(bare) == "Some CPU"
    assert cpu_model(tmp_path / "missing") is None
