"""Each implementation (column) of the grid, called on a row: the libraries it needs, the
row's inputs, and the forward (and backward) call that is timed."""

from __future__ import annotations

import contextlib
import time

from benchmarks.details_log import Log, first_line
from benchmarks.grid import OURS, Row


def _has_dist(name: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(name)
        return True
    except PackageNotFoundError:
        return False


class Implementations:
    """The imported libraries (torch, attention_dispatch, flash-attn 4, FlexAttention) and how
    each implementation (column) is called on a row's inputs."""

    def __init__(self, args, log: Log):
        import torch

        self.torch = torch
        self.args, self.log = args, log
        self.dev = "cpu" if args.smoke_cpu else "cuda"
        self.cuda = self.dev == "cuda"
        self.notes: list[str] = []
        self.flex_fn = None
        self.flex_error = None
        self.fa4 = None
        self.fa4_error = None
        self.fa4_version = "not importable"
        import attention_dispatch as ad
        from attention_dispatch.api import normalize_call  # noqa: F401 - fail early if the API moved

        self.ad = ad
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}

    def empty_cache(self) -> None:
        if self.cuda:
            self.torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    # -- optional libraries -------------------------------------------------------------------
    def load_fa4(self) -> None:
        t = time.perf_counter()
        try:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

            self.fa4 = (flash_attn_func, flash_attn_varlen_func)
            try:
                from importlib.metadata import version

                self.fa4_version = next(
                    (version(n) for n in ("flash-attn-4", "flash_attn_4", "flash-attn") if _has_dist(n)), "present"
                )
            except Exception:  # noqa: BLE001
                self.fa4_version = "present"
            self.log(f"flash_attn.cute imported ({self.fa4_version}) in {time.perf_counter() - t:.1f} s")
        except Exception as e:  # noqa: BLE001
            self.fa4_error = first_line(e)
            self.notes.append(f"flash-attn 4 not measured: `from flash_attn.cute import ...` failed: {self.fa4_error}")
            self.log(f"flash-attn 4 unavailable: {self.fa4_error}")

    def load_flex(self) -> None:
        torch = self.torch
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            cfg = torch._dynamo.config
            for name in (
                "cache_size_limit",
                "recompile_limit",
                "accumulated_cache_size_limit",
                "accumulated_recompile_limit",
            ):
                if hasattr(cfg, name):
                    setattr(cfg, name, 4096)
            self.flex_fn = torch.compile(flex_attention, dynamic=False)
            self.create_block_mask = create_block_mask
        except Exception as e:  # noqa: BLE001
            self.flex_error = first_line(e)
            self.notes.append(f"FlexAttention not measured: {self.flex_error}")
            self.log(f"flex unavailable: {self.flex_error}")

    # -- inputs ------------------------------------------------------------------------------
    def make_inputs(self, row: Row) -> dict:
        torch = self.torch
        dt, dev = self.dtypes[row.dtype], self.dev
        g = torch.Generator(device=dev)
        g.manual_seed(self.args.seed)

        def rnd(*shape):
            return torch.randn(*shape, device=dev, dtype=dt, generator=g)

        if row.feature == "varlen":
            T = sum(row.lengths)
            q, k, v, do = rnd(T, row.Hq, row.D), rnd(T, row.Hkv, row.D), rnd(T, row.Hkv, row.D), rnd(T, row.Hq, row.D)
            cu = [0]
            for n in row.lengths:
                cu.append(cu[-1] + n)
            inp = dict(
                q=q,
                k=k,
                v=v,
                do=do,
                cu=torch.tensor(cu, device=dev, dtype=torch.int32),
                cu_list=cu,
                max_seqlen=row.max_seqlen,
            )
        else:
            q = rnd(row.B, row.Hq, row.S, row.D)
            k, v = rnd(row.B, row.Hkv, row.S, row.D), rnd(row.B, row.Hkv, row.S, row.D)
            inp = dict(q=q, k=k, v=v, do=rnd(row.B, row.Hq, row.S, row.D))
        inp["bias"] = rnd(1, row.Hq, row.S, row.S) if row.feature == "bias" else None
        for name in ("q", "k", "v"):
            inp[name].requires_grad_(True)
        return inp

    # -- one implementation of one row: (fwd, leaves, grad_out, canon, ctx) ----------------------
    def prepare(self, impl: str, row: Row, inp: dict):
        torch = self.torch
        F = torch.nn.functional
        q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
        gqa = row.Hq != row.Hkv
        ident = lambda o: o
        if impl in OURS:
            ad = self.ad
            forced = "triton" if impl == "triton" else None
            kw = dict(
                attn_mask=inp["bias"],
                dropout_p=row.dropout_p,
                is_causal=row.causal,
                enable_gqa=gqa,
                window=row.window,
                backend=forced,
            )
            if row.feature == "varlen":
                kw.update(
                    cu_seqlens_q=inp["cu"],
                    cu_seqlens_k=inp["cu"],
                    max_seqlen_q=inp["max_seqlen"],
                    max_seqlen_k=inp["max_seqlen"],
                )

            def fwd():
                return ad.sdpa(q, k, v, **kw)

            if impl == "fastest":
                return fwd, (q, k, v), do, ident, (lambda: ad.use_config({"dispatch": {"policy": "fastest"}}))
            return fwd, (q, k, v), do, ident, contextlib.nullcontext
        if impl in ("cudnn", "torch_flash", "torch_efficient"):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            be = {
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "torch_flash": SDPBackend.FLASH_ATTENTION,
                "torch_efficient": SDPBackend.EFFICIENT_ATTENTION,
            }[impl]

            def ctx():
                return sdpa_kernel([be])

            extra = {"enable_gqa": True} if gqa else {}
            if row.feature == "varlen":
                offsets = inp["cu"].to(torch.int64)
                m = inp["max_seqlen"]

                def nest(t):
                    return torch.nested.nested_tensor_from_jagged(
                        t, offsets, min_seqlen=min(row.lengths), max_seqlen=m
                    ).transpose(1, 2)

                def fwd():
                    o = F.scaled_dot_product_attention(
                        nest(q), nest(k), nest(v), dropout_p=row.dropout_p, is_causal=row.causal, **extra
                    )
                    return o.transpose(1, 2).values()

                return fwd, (q, k, v), do, ident, ctx

            def fwd():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=inp["bias"], dropout_p=row.dropout_p, is_causal=row.causal, **extra
                )

            return fwd, (q, k, v), do, ident, ctx
        if impl == "fa4":
            func, varlen_func = self.fa4
            window = (None, None) if row.window is None else row.window
            if row.feature == "varlen":
                m = inp["max_seqlen"]

                def fwd():
                    o = varlen_func(
                        q,
                        k,
                        v,
                        cu_seqlens_q=inp["cu"],
                        cu_seqlens_k=inp["cu"],
                        max_seqlen_q=m,
                        max_seqlen_k=m,
                        causal=row.causal,
                        window_size=window,
                    )
                    return o[0] if isinstance(o, tuple) else o

                return fwd, (q, k, v), do, ident, contextlib.nullcontext
            qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
            dob = do.transpose(1, 2).contiguous()

            def fwd():
                o = func(qb, kb, vb, causal=row.causal, window_size=window)
                return o[0] if isinstance(o, tuple) else o

            return fwd, (qb, kb, vb), dob, (lambda o: o.transpose(1, 2)), contextlib.nullcontext
        if impl == "flex":
            return self.prepare_flex(row, inp)
        raise ValueError(impl)

    def mode_calls(self, impl: str, fwd, leaves, go) -> dict:
        """What one measurement of each mode calls: the forward as inference (no_grad), except
        Flex whose compiled graph depends on the grad mode, and forward + backward."""
        torch = self.torch

        def fb():
            o = fwd()
            torch.autograd.grad(o, leaves, go)

        def fwd_inference():
            with torch.no_grad():
                return fwd()

        return {"fwd": fwd if impl == "flex" else fwd_inference, "fwd+bwd": fb}

    def prepare_flex(self, row: Row, inp: dict):
        torch = self.torch
        q, k, v, do = inp["q"], inp["k"], inp["v"], inp["do"]
        cbm, dev = self.create_block_mask, self.dev
        score_mod, bm, canon = None, None, (lambda o: o)
        S = row.S
        if row.feature == "varlen":
            lens = torch.tensor(row.lengths, device=dev)
            doc = torch.repeat_interleave(torch.arange(len(row.lengths), device=dev), lens)
            causal = row.causal

            def mask_mod(b, h, qi, ki):
                same = doc[qi] == doc[ki]
                return (same & (qi >= ki)) if causal else same

            bm = cbm(mask_mod, None, None, S, S, device=dev)
            q, k, v = (
                t.detach().transpose(0, 1).unsqueeze(0).contiguous().requires_grad_(t.requires_grad) for t in (q, k, v)
            )
            do = do.transpose(0, 1).unsqueeze(0).contiguous()
            canon = lambda o: o[0].transpose(0, 1)
        elif row.feature == "window":
            left = row.window[0]

            def mask_mod(b, h, qi, ki):
                return (qi >= ki) & (qi - ki <= left)

            bm = cbm(mask_mod, None, None, S, S, device=dev)
        elif row.causal:

            def mask_mod(b, h, qi, ki):
                return qi >= ki

            bm = cbm(mask_mod, None, None, S, S, device=dev)
        if row.feature == "bias":
            bias = inp["bias"]

            def score_mod(score, b, h, qi, ki):
                return score + bias[0, h, qi, ki]

        flex, gqa = self.flex_fn, row.Hq != row.Hkv

        def fwd():
            return flex(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa)

        return fwd, (q, k, v), do, canon, contextlib.nullcontext
