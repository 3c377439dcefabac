"""attention_dispatch.integrations.transformers: tiny random models built from configs (no downloads),
each compared with the same weights under attn_implementation="sdpa", and each asserting that
ad.sdpa actually ran (ad.record() sees one decision per attention call)."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import attention_dispatch as ad  # noqa: E402
from attention_dispatch.integrations import transformers as ad_hf  # noqa: E402

NAME = ad_hf.register()


@pytest.fixture(autouse=True)
def _seed_and_backends():
    """PyTorch's CPU kernel and the math reference; our Triton kernel (interpreted on the CPU, ~2 s a
    call) only where a test asks for all_backends, so that each test stays within seconds."""
    torch.manual_seed(0)
    with ad.use_backends("torch_cpu", "math"):
        yield


@pytest.fixture
def all_backends():
    """Undo _seed_and_backends' restriction: every backend, in the default order."""
    with ad.use_backends(*ad.list_backends()):
        yield


def _pair(config, auto=transformers.AutoModelForCausalLM, dtype=torch.float32, train=False, reference="sdpa"):
    """(ours, reference) with the same weights; each model gets its own copy of the config
    (from_config writes attn_implementation into the config it is given)."""
    ref = auto.from_config(copy.deepcopy(config), attn_implementation=reference).to(dtype)
    ours = auto.from_config(copy.deepcopy(config), attn_implementation=NAME).to(dtype)
    ours.load_state_dict(ref.state_dict())
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == reference
    return (ours.train(), ref.train()) if train else (ours.eval(), ref.eval())


def _llama(**kw):
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return transformers.LlamaConfig(**{**base, **kw})


def _left_padded(batch=3, length=10, vocab=61, pads=(4, 0, 1)):
    ids = torch.randint(3, vocab, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
        ids[row, :n] = 0
    return ids, mask


def _loss_and_grads(model, inputs, rows):
    """Logits, and every parameter's gradient of a random projection of the logits in `rows`."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    keep = torch.ones(logits.shape[:2], dtype=torch.bool) if rows is None else rows
    weights = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(1))
    (logits * weights)[keep].sum().backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def _assert_same(ours, ref, inputs, atol=None, rtol=None, rows=None):
    """Logits (in `rows`: a padded query row's output is never read) and every parameter's gradient;
    the default tolerances are torch.testing's for the dtype (float32: rtol 1.3e-6, atol 1e-5)."""
    (lo, go), (lr, gr) = _loss_and_grads(ours, inputs, rows), _loss_and_grads(ref, inputs, rows)
    keep = slice(None) if rows is None else rows
    torch.testing.assert_close(lo[keep], lr[keep], atol=atol, rtol=rtol)
    assert go.keys() == gr.keys()
    for name in gr:
        assert gr[name] is not None and go[name] is not None, name
        torch.testing.assert_close(go[name], gr[name], atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")


def _calls(decisions, layers, forwards=1):
    assert len(decisions) == layers * forwards, [d.problem.summary() for d in decisions]
    assert all(d.backend for d in decisions)


# ---------------------------------------------------------------- registration


def test_register_refuses_names_transformers_treats_as_its_own():
    for bad in ("my_sdpa", "flash_attention_ad", "flex_attention", "org/kernel", "eager", ""):
        with pytest.raises(ValueError, match="choose another"):
            ad_hf.register(bad)
    assert ad_hf.register() == "attention_dispatch"
    assert transformers.AttentionInterface._global_mapping[NAME] is ad_hf.attention_forward
    assert transformers.masking_utils.AttentionMaskInterface._global_mapping[NAME] is ad_hf.attention_mask


def test_attention_function_alone_is_refused_never_silently_unmasked():
    """transformers builds no mask for a name without a mask function; padding would be ignored."""
    transformers.AttentionInterface.register("ad_attention_only", ad_hf.attention_forward)
    model = transformers.AutoModelForCausalLM.from_config(_llama(), attn_implementation="ad_attention_only")
    ids, mask = _left_padded()
    with pytest.raises(ValueError, match="no mask function"):
        model(input_ids=ids, attention_mask=mask)


# ---------------------------------------------------------------- Llama: padding, GQA, causal, caches


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
def test_llama_left_padding_logits_and_every_gradient_float32(backend):
    ours, ref = _pair(_llama())
    ids, mask = _left_padded()
    with ad.use_backends(backend), ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), rows=mask.bool())
    _calls(ds, layers=2)
    d = ds[0]
    assert {d.backend for d in ds} == {backend}
    assert d.problem.mask_kind == "bool" and d.problem.heads_kv == 2 and d.problem.heads_q == 4


@pytest.mark.parametrize("backend", ["torch_cpu", "math"])
def test_llama_left_padding_float64_within_1e_10(backend):
    ours, ref = _pair(_llama(), dtype=torch.float64)
    ids, mask = _left_padded()
    with ad.use_backends(backend), ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), atol=1e-10, rtol=0, rows=mask.bool())
    _calls(ds, layers=2)
    assert ds[0].problem.dtype == torch.float64


def test_llama_without_padding_uses_is_causal_not_a_mask():
    ours, ref = _pair(_llama())
    ids = torch.randint(3, 61, (2, 9))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids))
    _calls(ds, layers=2)
    assert {(d.problem.mask_kind, d.problem.causal) for d in ds} == {("none", ad.CausalKind.TOP_LEFT)}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_greedy_generate_token_identical(cache):
    ours, ref = _pair(_llama())
    ids, mask = _left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0, cache_implementation=cache)
    with ad.record() as ds:
        got = ours.generate(ids, **kw)
    want = ref.generate(ids, **kw)
    assert got.shape == (3, 30)
    assert torch.equal(got, want)
    _calls(ds, layers=2, forwards=20)
    assert {d.problem.seqlen_q for d in ds} == {10, 1}


def test_dropout_in_training_mode():
    ours, _ = _pair(_llama(attention_dropout=0.5), train=True)
    ids = torch.randint(3, 61, (2, 8))
    with ad.record() as ds:
        torch.manual_seed(3)
        a = ours(input_ids=ids).logits
        torch.manual_seed(3)
        b = ours(input_ids=ids).logits
        c = ours.eval()(input_ids=ids).logits
    _calls(ds, layers=2, forwards=3)
    assert [d.problem.dropout for d in ds] == [True] * 4 + [False] * 2
    torch.testing.assert_close(a, b)  # repeatable under torch.manual_seed
    assert not torch.allclose(a, c)


# ---------------------------------------------------------------- sliding windows as window=


def _mistral(window=4):
    return transformers.MistralConfig(**{**_llama().to_dict(), "sliding_window": window, "model_type": "mistral"})


def test_mistral_sliding_window_shorter_than_the_sequence_runs_as_window():
    ours, ref = _pair(_mistral(window=4))
    ids = torch.randint(3, 61, (2, 12))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids))
    _calls(ds, layers=2)
    # no materialised mask: the window reaches ad.sdpa as window=(3, 0), top-left causal
    assert {(d.problem.mask_kind, d.problem.window) for d in ds} == {("none", (3, 0))}


def test_mistral_sliding_window_with_left_padding_and_generate():
    ours, ref = _pair(_mistral(window=4))
    ids, mask = _left_padded(length=12)
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), rows=mask.bool())
    _calls(ds, layers=2)
    assert {d.problem.mask_kind for d in ds} == {"bool"}  # padding needs a mask; it holds the window
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with ad.record() as ds:
        got = ours.generate(ids, **kw)
    assert torch.equal(got, ref.generate(ids, **kw))
    _calls(ds, layers=2, forwards=8)
    one = ids[:1, 4:]  # one sequence, no padding: every step takes window=
    with ad.record() as ds:
        got = ours.generate(one, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, ref.generate(one, max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert {(d.problem.mask_kind, d.problem.window) for d in ds} == {("none", (3, 0))}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_mistral_window_generate_with_each_cache(cache):
    """Static caches keep sliding layers in a window-sized buffer (a mask then says which slots are
    filled); a dynamic one keeps the last window - 1 keys: both token-identical to "sdpa"."""
    ours, ref = _pair(_mistral(window=4))
    ids, mask = _left_padded(length=12)
    for inputs in (dict(attention_mask=mask), {}):
        prompt = ids if inputs else ids[:1, 4:]
        kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, cache_implementation=cache, **inputs)
        with ad.record() as ds:
            got = ours.generate(prompt, **kw)
        assert torch.equal(got, ref.generate(prompt, **kw))
        _calls(ds, layers=2, forwards=10)
    # without padding the prompt runs with window=, no mask
    assert (ds[0].problem.mask_kind, ds[0].problem.window, ds[0].problem.seqlen_q) == ("none", (3, 0), 8)


def test_mistral_window_compiled_fullgraph():
    """Under torch.compile the plain sliding-window mask is still recognised (without reading closures)."""
    ours, ref = _pair(_mistral(window=4))
    ids, mask = _left_padded(length=12)
    for inputs in (dict(input_ids=ids, attention_mask=mask), dict(input_ids=ids[:, 4:])):
        torch._dynamo.reset()
        compiled = torch.compile(ours, backend="eager", fullgraph=True, dynamic=False)
        with ad.use_backends("math"), ad.record() as ds:
            got = compiled(**inputs).logits
        rows = inputs.get("attention_mask", torch.ones(got.shape[:2])).bool()
        torch.testing.assert_close(got[rows], ref(**inputs).logits[rows])
        _calls(ds, layers=2)
    kinds = {(d.problem.mask_kind, d.problem.window) for d in ds}
    if kinds != {("none", (3, 0))}:  # transformers before 5.2x materialises even a full causal mask when compiling
        llama, _ = _pair(_llama())
        torch._dynamo.reset()
        with ad.use_backends("math"), ad.record() as full:
            torch.compile(llama, backend="eager", fullgraph=True, dynamic=False)(input_ids=ids[:, 4:])
        assert {d.problem.mask_kind for d in full} == {"bool"}, kinds


def test_readme_example_runs_as_written(capsys):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("## Use it from transformers / any model", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("8 attention_dispatch: ") and printed[-1] in ("torch_cpu", "math")


def test_triton_kernel_through_the_integration(all_backends):
    """Our Triton kernel (interpreted on the CPU under TRITON_INTERPRET=1) serves window= and the padding mask."""
    q = torch.randn(1, 2, 4, 8)
    if ad.explain(q, q, q).backend != "triton":
        pytest.skip("the triton backend is not chosen here (on the CPU it needs TRITON_INTERPRET=1)")
    ours, ref = _pair(_mistral(window=4))
    ids, mask = _left_padded(batch=2, length=12, pads=(3, 0))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids[1:]))
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), rows=mask.bool())
    _calls(ds, layers=2, forwards=2)
    assert [(d.backend, d.problem.window, d.problem.mask_kind) for d in ds] == [("triton", (3, 0), "none")] * 2 + [
        ("triton", None, "bool")
    ] * 2


def test_qwen2_hybrid_layers_window_only_where_sliding():
    cfg = transformers.Qwen2Config(
        **{k: v for k, v in _llama().to_dict().items() if k in ("vocab_size", "hidden_size", "intermediate_size")},
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=1,  # layer 0 full attention, layer 1 sliding
        pad_token_id=0,
    )
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    ours, ref = _pair(cfg)
    ids = torch.randint(3, 61, (2, 10))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids))
    _calls(ds, layers=2)
    assert [d.problem.window for d in ds] == [None, (2, 0)]


# ---------------------------------------------------------------- padding-free packed batches


@pytest.mark.parametrize("model", ["llama", "mistral_window_4"])
@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_packed_batch_equals_the_sequences_run_alone(model, flash_kwargs):
    """DataCollatorWithFlattening: with cu_seq_lens/max_length kwargs one varlen call (a window
    included); with position_ids only, transformers' block-diagonal mask, as for "sdpa" (which
    transformers derives only without a cache: use_cache=False, as in training)."""
    ours, ref = _pair(_llama() if model == "llama" else _mistral(window=4))
    lengths = (5, 9, 3)
    seqs = [torch.randint(3, 61, (n,)).tolist() for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(
        [{"input_ids": s} for s in seqs]
    )
    batch.pop("labels")
    if flash_kwargs:
        assert batch["cu_seq_lens_q"].tolist() == [0, 5, 14, 17]
    else:
        batch["use_cache"] = False
    with ad.record() as ds:
        packed = ours(**batch).logits[0]
    _calls(ds, layers=2)
    if flash_kwargs:
        want = (None, "varlen") if model == "llama" else ((3, 0), "varlen")
        assert {(d.problem.window, d.problem.layout) for d in ds} == {want}
    else:
        assert {(d.problem.layout, d.problem.mask_kind) for d in ds} == {("dense", "bool")}
    alone = torch.cat([ref(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    torch.testing.assert_close(packed, alone)
    # gradients: the packed batch's equal the sum over the sequences run alone
    w = torch.arange(packed.numel()).view_as(packed).sin()
    (packed * w).sum().backward()
    ours_grads = {n: p.grad for n, p in ours.named_parameters()}
    ref.zero_grad()
    bounds = torch.tensor((0, *lengths)).cumsum(0).tolist()
    sum(
        (ref(input_ids=torch.tensor([s])).logits[0] * w[a:b]).sum() for s, a, b in zip(seqs, bounds, bounds[1:])
    ).backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(ours_grads[n], p.grad, msg=lambda m, n=n: f"{n}: {m}")


# ---------------------------------------------------------------- T5: position bias, encoder, cross-attention


def _t5():
    return transformers.T5Config(
        vocab_size=61,
        d_model=32,
        d_kv=8,
        d_ff=48,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_t5_position_bias_gradients_encoder_and_cross_attention(dtype):
    ours, ref = _pair(_t5(), auto=transformers.AutoModelForSeq2SeqLM, dtype=dtype)
    ids, mask = _left_padded(length=9, pads=(0, 3, 1))
    dec = torch.randint(3, 61, (3, 6))
    inputs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    tol = dict(atol=1e-10, rtol=0) if dtype == torch.float64 else {}
    with ad.record() as ds:
        _assert_same(ours, ref, inputs, **tol)
    _calls(ds, layers=6)  # 2 encoder self, 2 decoder self, 2 cross
    enc, dec_self, cross = ds[:2], ds[2::2], ds[3::2]
    assert all(d.problem.mask_kind == "float" for d in ds)
    # the learned bias keeps its gradient; the decoder's causal mask stays an argument, not a materialised mask
    assert all(d.problem.mask_requires_grad and d.problem.causal is None for d in enc)
    assert all(d.problem.mask_requires_grad and d.problem.causal == ad.CausalKind.TOP_LEFT for d in dec_self)
    assert all(d.problem.seqlen_q == 6 and d.problem.seqlen_k == 9 and d.problem.causal is None for d in cross)
    for stack in ("encoder", "decoder"):
        bias = dict(ours.named_parameters())[f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        assert bias.grad is not None and bias.grad.abs().sum() > 0


# ---------------------------------------------------------------- BERT: bidirectional encoder, decoder with cross-attention


def _bert(**kw):
    return transformers.BertConfig(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        max_position_embeddings=64,
        **kw,
    )


def test_bert_encoder_with_padding():
    ours, ref = _pair(_bert(), auto=transformers.AutoModelForMaskedLM)
    ids, mask = _left_padded(pads=(0, 3, 6))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), rows=mask.bool())
    _calls(ds, layers=2)
    assert all(d.problem.causal is None and d.problem.mask_kind == "bool" for d in ds)
    with ad.record() as ds:  # no padding: no mask, not causal
        _assert_same(ours, ref, dict(input_ids=ids[:1]))
    assert all(d.problem.causal is None and d.problem.mask_kind == "none" for d in ds)


def test_bert_decoder_with_cross_attention():
    ours, ref = _pair(_bert(is_decoder=True, add_cross_attention=True))
    ids = torch.randint(3, 61, (2, 7))
    enc = torch.randn(2, 5, 32)
    enc_mask = torch.ones(2, 5, dtype=torch.long)
    enc_mask[1, 3:] = 0
    inputs = dict(input_ids=ids, encoder_hidden_states=enc, encoder_attention_mask=enc_mask)
    with ad.record() as ds:
        _assert_same(ours, ref, inputs)
    _calls(ds, layers=4)
    self_attn, cross = ds[0::2], ds[1::2]
    assert all(d.problem.causal == ad.CausalKind.TOP_LEFT for d in self_attn)
    assert all(d.problem.causal is None and d.problem.seqlen_k == 5 and d.problem.mask_kind == "bool" for d in cross)


# ---------------------------------------------------------------- softcapping (Gemma 2) and sinks (GPT-OSS)


def _gemma2(**kw):
    return transformers.Gemma2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        **kw,
    )


def test_gemma2_softcap_matches_eager():
    ours, ref = _pair(_gemma2(attn_logit_softcapping=2.0), reference="eager")  # Gemma 2 refuses "sdpa"
    ids, mask = _left_padded(pads=(3, 0, 1))
    with ad.record() as ds:  # eager sums in another order: float32 rounding of the largest gradients
        _assert_same(ours, ref, dict(input_ids=ids, attention_mask=mask), atol=1e-4, rtol=1e-4, rows=mask.bool())
    _calls(ds, layers=2)
    assert all(d.problem.softcap for d in ds)


def test_gpt_oss_sinks_match_eager_with_their_gradient():
    cfg = transformers.GptOssConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
    )
    ours, ref = _pair(cfg, reference="eager")
    for model in (ours, ref):  # random sinks, the same in both (they start at zero)
        for layer in model.model.layers:
            torch.manual_seed(layer.self_attn.layer_idx)
            layer.self_attn.sinks.data.normal_()
    ids = torch.randint(3, 61, (2, 9))
    with ad.record() as ds:
        _assert_same(ours, ref, dict(input_ids=ids), atol=1e-4, rtol=1e-4)
    _calls(ds, layers=2)
    assert all(d.problem.sinks_grad for d in ds)
    sinks = ours.model.layers[0].self_attn.sinks
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


def test_gemma2_without_softcap_runs():
    cfg = transformers.Gemma2Config(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=4,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
    )
    ours, ref = _pair(cfg, reference="eager")  # Gemma 2 refuses "sdpa" (and every name containing it)
    ids = torch.randint(3, 61, (2, 9))
    with ad.record() as ds:  # eager sums in another order: float32 rounding of the largest gradients
        _assert_same(ours, ref, dict(input_ids=ids), atol=1e-4, rtol=1e-4)
    _calls(ds, layers=2)
    assert [d.problem.window for d in ds] == [(3, 0), None]  # sliding, full, as layer_types says
    assert ds[0].problem.heads_q == 4
