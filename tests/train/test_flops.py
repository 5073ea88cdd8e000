"""The MFU's denominator: the dense bf16 peak of a GPU by its name (the names torch reports for
them), a measured one for a GPU the table lacks, and the measured matmul peak on the CPU."""
import pytest
import torch

from shardmoe.train import flops
from shardmoe.train.flops import known_peak, peak_flops


@pytest.mark.parametrize("name, label, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4), ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5), ("NVIDIA H200", "H200", 989.4), ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4), ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0), ("NVIDIA A100 80GB PCIe", "A100", 312.0),
    ("NVIDIA L40S", "L40S", 362.05), ("NVIDIA GeForce RTX 4090", "RTX 4090", 165.2),
    ("AMD Instinct MI300X", "MI300X", 1307.4)])
def test_a_known_gpu_gets_its_datasheets_dense_bf16_peak(name, label, tflops):
    peak = known_peak(name)
    assert peak.flops == pytest.approx(tflops * 1e12) and f"the {label}'s dense bf16 peak" in peak.source


def test_a_run_on_a_gpu_divides_by_the_table_or_a_measured_bf16_peak(monkeypatch):
    """On a GPU the table's peak whatever the run's dtype; one it does not name is measured in bf16
    on the device (the measurement recorded here, not run)."""
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA Tesla T4"])
    measured = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: next(names))
    monkeypatch.setattr(flops, "measure_peak_flops",
                        lambda dtype, device, size: measured.append((dtype, device, size)) or 50e12)
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu, torch.float32).flops == pytest.approx(989.4e12)
    unknown = peak_flops(gpu, torch.float32)
    assert unknown.flops == 50e12 and measured == [(torch.bfloat16, gpu, 4096)]
    assert unknown.source == "a measured bf16 matmul peak of 50 TFLOP/s (NVIDIA Tesla T4 is not in the table)"
    assert known_peak("NVIDIA Tesla T4") is None


def test_on_the_cpu_the_peak_is_a_measured_matmul_in_the_runs_dtype():
    peak = peak_flops(torch.device("cpu"), torch.float64)
    assert peak.flops > 0 and peak.source.endswith("GFLOP/s float64 matmul peak per rank")
