"""The CUDA path (tier `gpu`, skipped without a GPU; scripts/gpu_check.sh runs it on a lent machine).

Needs only torch, transformers, pydantic, pyyaml and safetensors: no Ray, vLLM or MLflow. On CUDA the
drafter attends through compiled flex attention (drafter/model.py) with a BlockMask from the P-EAGLE rule
(train/masks.flex_mask_mod); on CPU through SDPA with the dense rule. Both must give the same loss and
gradients, in float32 and (within bfloat16's tolerance) under bfloat16 autocast.
"""

import copy

import pytest
import torch

from peagle_ray.bench.shapes import bench_arch, random_drafter
from peagle_ray.config import DrafterConfig, TrainingConfig
from peagle_ray.train.elements import TrainSequence, cod_sample
from peagle_ray.train.step import make_optimizer, sequence_backward, train_step
from tests.drafter_helpers import tiny_arch

pytestmark = pytest.mark.gpu


def random_sequence(n: int, arch, seed: int = 0) -> TrainSequence:
    g = torch.Generator().manual_seed(seed)
    t = n + 1
    return TrainSequence.from_record(
        torch.randint(0, arch.vocab_size - 1, (t,), generator=g),
        torch.ones(t),
        torch.randn(t, arch.num_aux * arch.hidden_size, generator=g),
        torch.randn(t, arch.hidden_size, generator=g),
    )


def grads_of(drafter) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().float().cpu() for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("segment_length", [10**9, 48])  # whole, and partitioned into segments
def test_compiled_flex_on_cuda_equals_sdpa_on_cpu_in_loss_and_gradients(segment_length):
    # flex's fused kernel wants head_dim >= 16: an odd-sized drafter otherwise (vocab 37, 97 positions)
    arch = tiny_arch(num_depths=3, num_heads=4, num_kv_heads=2, head_dim=16, hidden_size=64, intermediate_size=96)
    cpu, teacher = random_drafter(arch, seed=5)
    gpu, gpu_teacher = copy.deepcopy(cpu).cuda(), copy.deepcopy(teacher).cuda()
    seq = random_sequence(97, arch)
    elements = cod_sample(seq.supervised, seq.doc_ids, 3, 0.7, 0.2, torch.Generator().manual_seed(1))
    on_cpu = sequence_backward(cpu, teacher, seq, elements, segment_length, None)
    on_gpu = sequence_backward(gpu, gpu_teacher, seq, elements, segment_length, None)
    assert on_gpu.loss == pytest.approx(on_cpu.loss, rel=1e-4)
    expected, got = grads_of(cpu), grads_of(gpu)
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-3, atol=1e-4, msg=name)


def test_bfloat16_flex_gradients_track_float32():
    arch = bench_arch("peagle", 4, 4096)  # SmolLM2's width, a small draft vocabulary
    drafter, teacher = random_drafter(arch)
    drafter, teacher = drafter.cuda(), teacher.cuda()
    seq = random_sequence(1024, arch)
    elements = cod_sample(seq.supervised, seq.doc_ids, 4, 0.7, 0.2, torch.Generator().manual_seed(2))
    full = sequence_backward(drafter, teacher, seq, elements, 2048, None)
    reference = grads_of(drafter)
    drafter.zero_grad(set_to_none=True)
    half = sequence_backward(drafter, teacher, seq, elements, 2048, None, bf16=True)
    assert half.loss == pytest.approx(full.loss, rel=2e-2)
    for name, grad in grads_of(drafter).items():
        cosine = torch.nn.functional.cosine_similarity(grad.flatten(), reference[name].flatten(), dim=0)
        assert cosine > 0.98, (name, float(cosine))


def test_bfloat16_training_steps_on_a_smollm2_shaped_drafter_reduce_the_loss():
    arch = bench_arch("peagle", 4, 32768)
    drafter, teacher = random_drafter(arch)
    drafter, teacher = drafter.cuda(), teacher.cuda()
    cfg = TrainingConfig(precision="bfloat16", learning_rate=2e-3, warmup_steps=0, max_steps=8, segment_length=4096)
    optimizer, scheduler = make_optimizer(drafter, cfg)
    seq, g = random_sequence(2048, arch, seed=3), torch.Generator().manual_seed(4)
    losses = [
        train_step(drafter, teacher, optimizer, scheduler, [seq], DrafterConfig(num_depths=4), cfg, g).loss
        for _ in range(8)
    ]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
