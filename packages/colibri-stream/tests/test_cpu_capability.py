"""The capabilities the suite re-runs under come from the CPU's flags, never from what torch accepts."""

from __future__ import annotations

from colibri_stream.compute.cpu_capability import cpu_flags, supported_capabilities

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2\n"


def test_levels_follow_the_flags():
    assert supported_capabilities(cpu_flags(ZEN5), "x86_64") == ["default", "avx2", "avx512"]
    assert supported_capabilities(cpu_flags(ZEN3), "x86_64") == ["default", "avx2"]
    assert supported_capabilities(cpu_flags("flags : sse2 avx512f\n"), "x86_64") == ["default"]  # no fma, no bw/dq/vl


def test_other_architectures_and_missing_cpuinfo():
    assert supported_capabilities({"asimd", "sve"}, "aarch64") == ["default"]
    assert cpu_flags("") == set()


def test_this_machine_lists_default_first():
    caps = supported_capabilities()
    assert caps[0] == "default" and len(set(caps)) == len(caps)


def test_besides_native_leaves_out_what_torch_picked(capsys, monkeypatch):
    from colibri_stream.compute import cpu_capability

    monkeypatch.setattr(cpu_capability, "native_capability", lambda: "avx2")
    monkeypatch.setattr(cpu_capability, "supported_capabilities", lambda: ["default", "avx2"])
    cpu_capability.main(["--besides-native"])
    assert capsys.readouterr().out.split() == ["default"]
