import importlib
import importlib.util
import json
import os
import sys
from pathlib import Path

# The Triton interpreter runs tl.dot as numpy's matmul, i.e. OpenBLAS. Its Haswell/Zen sgemm sums a row of a
# tile in an order that depends on the row's place in the tile (main and remainder micro-kernels), so the
# interpreter would break the batch invariance that the compiled kernels have; the Nehalem kernels keep one
# order for every row. Set before numpy is first imported (torch imports it).
os.environ.setdefault("OPENBLAS_CORETYPE", "Nehalem")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings
from torch.utils._python_dispatch import TorchDispatchMode

# The checkout's folders are bitrl's subpackages (bitrl.kernels, ...), not top-level packages, but
# `python -m pytest` puts the working directory on sys.path, where kernels/ shadows the Hugging Face
# `kernels` package that transformers >= 5.25 imports. Drop it here, and keep subprocesses (`python -m ...`)
# from adding it back.
# pytest puts the rootdir back before some tests, so the real package is also imported here, once: later
# imports of `kernels` find it in sys.modules.
_ROOT = Path(__file__).resolve().parent.parent


def _drop_checkout_root() -> None:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]


_drop_checkout_root()
os.environ["PYTHONSAFEPATH"] = "1"
if importlib.util.find_spec("kernels") is not None:
    importlib.import_module("kernels")

# Property tests draw the same examples on every run, so a test run never fails on a case no earlier run has
# seen (to explore new examples: HYPOTHESIS_PROFILE=explore).
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Warm starts cached by tests never touch the user's cache; the checkout's root stays off sys.path."""
    _drop_checkout_root()
    monkeypatch.setenv("BITRL_CACHE", str(tmp_path_factory.getbasetemp() / "bitrl-cache"))


@pytest.fixture(
    params=[(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)],
    ids=["bf16-matmuls", "bf16-matmuls-torch-softmax", "fp32-matmuls"],
)
def cpu_bf16_matmul(request, monkeypatch):
    """Every CPU path of bf16 inputs on any machine: bf16 GEMMs (CPUs with bf16 units), their tiles' softmax
    passes in the host C++ kernels (where a compiler exists) or in the torch formula (``BITRL_HOST_EXT=0``),
    and fp32 GEMMs of the bf16 operands (CPUs without bf16 units). Yields the matmul dtype."""
    fl = importlib.import_module("bitrl.kernels.fused_logprobs.numerics")  # where CPU_BF16_MATMUL is read

    matmul, host = request.param
    monkeypatch.setattr(fl, "CPU_BF16_MATMUL", matmul)
    if not host:
        monkeypatch.setenv("BITRL_HOST_EXT", "0")
    return matmul


def tile_elem_bytes(dtype: torch.dtype, entropy: bool) -> int:
    """Bytes per [token x vocabulary] tile element of the torch backend: fp32 logits (and probabilities with
    entropy), plus a bf16 copy where bf16 inputs multiply in bf16 (fp64: fp64 buffers); the bf16 copy alone
    where the host kernels run its softmax passes."""
    from bitrl.kernels import host_ext

    fl = importlib.import_module("bitrl.kernels.fused_logprobs.numerics")
    acc = 8 if dtype == torch.float64 else 4
    bf16_gemms = fl.CPU_BF16_MATMUL == torch.bfloat16  # noqa: SIM300 (a module attribute, not a constant)
    low = 2 if dtype == torch.bfloat16 and bf16_gemms else 0
    if low and host_ext.load_host_library() is not None:
        return low
    return acc * (2 if entropy else 1) + low


# Config overrides that shrink the demo model to one small layer, for tests that run the RL loop.
TINY_DEMO_MODEL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=1",
]


def make_qwen(seed: int = 0, **config):
    """A Qwen2 causal LM with random weights (seeded), fp32, eval mode; `config` overrides Qwen2Config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**config)).eval()


# A 2-layer Qwen2 causal LM with a 16-token vocabulary: the Qwen2Config of the tests' tiny models.
TINY_QWEN = dict(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture
def tiny_qwen():
    """A 2-layer Qwen2 causal LM with a 16-token vocabulary, random weights, fp32."""
    return make_qwen(**TINY_QWEN)


def save_tiny_hf_model(directory):
    """Write a random 2-layer Qwen2 model and a character-level fast tokenizer, as `save_pretrained` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    chars = list("0123456789+-=?.,: abcdefghijklmnopqrstuvwxyz")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(chars)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.fixture
def hf_model_dir(tmp_path):
    save_tiny_hf_model(tmp_path / "model")
    return tmp_path / "model"


def pytest_runtest_logreport(report):
    """With ``$BITRL_TEST_JSONL`` set, one JSON line per test as it ends: its outcome, seconds and, for a
    skip or a failure, why (the GPU check keeps every result even when its time runs out mid-suite)."""
    path = os.environ.get("BITRL_TEST_JSONL")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return
    line = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
    line["seconds"] = round(report.duration, 3)
    if report.skipped and isinstance(report.longrepr, tuple):
        line["why"] = report.longrepr[2]
    elif report.failed:
        line["why"] = report.longreprtext[-1500:]
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def pytest_sessionfinish(session, exitstatus):
    """Under the GPU check (``$BITRL_TEST_JSONL`` set), a group of tests none of which is selected (its
    CPU rehearsal keeps the ``gpu`` ones only) is not a failure."""
    if os.environ.get("BITRL_TEST_JSONL") and exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.OK


def pytest_report_header(config):
    """The machine a run's results depend on: CPU kind (summation order of torch's kernels, bf16 units), host
    compiler (the C++ softmax and sampler passes), CUDA and the Triton interpreter."""
    from bitrl.kernels import host_ext
    from bitrl.kernels.bench_stats import machine

    cpu, interpret = machine(), os.environ.get("TRITON_INTERPRET")
    return [
        f"torch {torch.__version__}, cuda: {torch.cuda.is_available()}, TRITON_INTERPRET={interpret}",
        f"cpu: {cpu['cpu']} ({cpu['cpus']} cores), ATen kernels {torch.backends.cpu.get_cpu_capability()}, "
        f"bf16 units: {', '.join(cpu['native_bf16']) or 'none'}, host C++ compiler: {host_ext.compiler()}",
    ]


class count_host_syncs(TorchDispatchMode):
    """Counts the ops that read a tensor's value back to the host (``bool(t)``, ``t.item()``, ``if t:``):
    on a GPU each is a device synchronisation (and a graph break under torch.compile). Works on CPU, where
    those ops are the same ``aten._local_scalar_dense`` / ``aten.is_nonzero`` calls.

        with count_host_syncs() as syncs:
            step()
        assert syncs.count == 0, syncs.ops"""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.equal", "aten.allclose")

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    @property
    def count(self) -> int:
        return len(self.ops)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.READS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def fp32_sum_bound(n_terms: int, mass: float, roundings: int = 8, dtype=torch.float32) -> float:
    """How far two evaluation orders of one sum can land apart: ``n_terms`` terms whose absolute values add up
    to ``mass``, each carrying up to ``roundings`` roundings of its own (exp, products, normalisers). Each
    order is within (n - 1 + roundings) * u * mass of the exact value (u = eps / 2, first order), so two
    orders differ by at most twice that. CPU kinds sum in other orders (torch's AVX2 against AVX-512/AMX
    kernels, MKL's blocking), so a test comparing two computations of one sum must allow this much."""
    return 2 * (n_terms - 1 + roundings) * (torch.finfo(dtype).eps / 2) * mass


def fp32_logprob_bound(hidden: torch.Tensor, weight: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Worst-case |log p - exact| per row of log_softmax(hidden @ weight.T / T) evaluated in fp32 from fp32
    operands, in any summation order (first order, u = 2^-24). hidden [N, H], weight [V, H] (any float
    dtype; the bound is computed in fp64). Each logit sums H products: |dz_v| <= (H + 1) u (|h| |w_v|) / T
    plus the rounding of z_v itself; log p_y = z_y - lse moves by at most 2 max_v |dz_v|, and the lse adds
    the rounding of a sum of V exponentials of relative error (V + 3) u (an absolute error on its log) and
    of its log and the subtraction (u |lse|, u |log p|). Entropy, -sum p log p, moves by at most
    (1 + max|log p|) times this."""
    u = 2.0**-24
    h, w = hidden.double(), weight.double()
    z = h @ w.T / temperature
    dz = (h.shape[-1] + 1) * u * (h.abs() @ w.abs().T) / temperature + u * z.abs()
    lse = torch.logsumexp(z, -1)
    logp_max = (z - lse[:, None]).abs().amax(-1)
    return 2 * dz.amax(-1) + (w.shape[0] + 3) * u + u * lse.abs() + u * logp_max


def assert_same_adam_update(got: torch.Tensor, want: torch.Tensor, lr: float, what: str = "") -> None:
    """Two runs of the same Adam steps whose gradients differ only in the order fp32 summed them
    (micro-batches, ranks, another CPU's kernels) leave the same weights up to a small part of one step.
    Adam's g / (sqrt(v) + eps) turns last-bit differences of a gradient that nearly cancels into a visible
    part of a step (measured: up to 0.4% of one), so per element the bound is 1% of lr, and over the whole
    model 1e-5 relative. A wrong or missing gradient moves elements by whole steps."""
    assert torch.linalg.vector_norm(got - want) <= 1e-5 * torch.linalg.vector_norm(want), what
    assert (got - want).abs().max() <= 1e-2 * lr, what


# The TrainConfig fields of the PolicyTrainer unit tests, over the schema's defaults: plain GRPO, fp32 (no
# autocast), a large lr. `TrainConfig(**TRAIN_CFG)` is their config.
TRAIN_CFG = dict(lr=1e-2, autocast="none")
