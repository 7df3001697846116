"""The pool of large CPU buffers the C++ kernels' outputs come from (runtime/cpu_memory.py): a
buffer is handed out again only once nothing but the pool holds it (a tensor, a view, a saved
tensor, a storage object), and a compiled step's large outputs reuse last step's buffers with
eager's values."""

import copy
import threading

import pytest
import torch

import compiler  # noqa: F401  (first)
from runtime import cpu_memory
from runtime.cpu_memory import MIN_BYTES, BufferPool
from tests.devices import BACKENDS

SHAPE = (MIN_BYTES // 4 // 64, 64)   # float32: exactly MIN_BYTES


def test_a_buffer_is_reused_only_once_nothing_else_holds_it():
    pool = BufferPool(limit=1 << 30)
    a = pool.empty(SHAPE, torch.float32)
    address = a.data_ptr()
    view = a[1:]
    storage = a.untyped_storage()
    del a
    other = pool.empty(SHAPE, torch.float32)
    assert other.data_ptr() != address   # a view holds it
    del view
    another = pool.empty(SHAPE, torch.float32)
    assert another.data_ptr() != address   # a storage object holds it
    del storage
    b = pool.empty(SHAPE, torch.float32)
    assert b.data_ptr() == address and pool.reused == 1
    # saved for backward: held by the graph until the backward frees it
    x = torch.randn(SHAPE, requires_grad=True)
    y = x * b
    del b
    c = pool.empty(SHAPE, torch.float32)
    assert c.data_ptr() not in (address, other.data_ptr(), another.data_ptr())
    y.sum().backward()
    del y
    assert pool.empty(SHAPE, torch.float32).data_ptr() == address
    # another dtype of the same bytes shares it; a tensor handed out is an ordinary one
    del c
    d = pool.empty((SHAPE[0] // 2, SHAPE[1]), torch.float64)
    assert d.dtype == torch.float64 and d.is_contiguous() and d.shape == (SHAPE[0] // 2, SHAPE[1])
    d.resize_(SHAPE[0], SHAPE[1] * 2)   # (a user's resize_ reallocates: the pool checks the size again)
    d.fill_(1.0)
    e = pool.empty(SHAPE, torch.float32)
    assert e.untyped_storage().nbytes() == MIN_BYTES


def test_small_buffers_a_full_pool_and_a_zero_limit_allocate_as_usual():
    pool = BufferPool(limit=MIN_BYTES)
    small = pool.empty((8, 8), torch.float32)
    assert small.shape == (8, 8) and pool.held == 0
    kept, not_kept = pool.empty(SHAPE, torch.float32), pool.empty(SHAPE, torch.float32)
    assert pool.held == MIN_BYTES
    off = BufferPool(limit=0)
    first = off.empty(SHAPE, torch.float32)
    assert off.held == 0 and first.shape == SHAPE
    del kept, not_kept


def test_the_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_memory.POOL_ENV, "12345")
    assert BufferPool().limit == 12345
    monkeypatch.setenv(cpu_memory.POOL_ENV, "lots")
    with pytest.raises(ValueError, match="SYMGRAD_CPU_POOL_BYTES"):
        BufferPool()


def test_threads_never_share_a_buffer():
    pool = BufferPool(limit=1 << 30)
    taken, errors = [], []

    def work():
        try:
            for _ in range(50):
                t = pool.empty(SHAPE, torch.float32)
                mark = float(threading.get_ident() % 1000)
                t.fill_(mark)
                taken.append(t.data_ptr())
                assert bool((t == mark).all())   # (no other thread wrote into it meanwhile)
        except AssertionError as e:
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.reused > 0


@pytest.mark.skipif("cpp" not in BACKENDS, reason="no working C++ compiler here")
def test_a_compiled_steps_large_outputs_reuse_last_steps_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    x = torch.randn(512, 256)

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    compiled = compiler.compile(step, backend="cpp")
    before = cpu_memory.POOL.reused
    for _ in range(4):
        torch.testing.assert_close(compiled(model, opt, x), step(reference, ref_opt, x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert compiled.last_backend == "cpp" and compiled.stats["divergences"] == 0
    assert cpu_memory.POOL.reused > before   # (the 512x1024 GELU values: 2 MB, from last step's buffer)
