"""Real-user data path (issue 13): jsonl shapes, a chat template's raise_exception, math-verify agreement,
prompts that cannot fit refused at load. CPU, no model: ~30 s."""
import json

import pytest

import data


def _tiny_tokenizer_dir(tmp_path, template, bos, eos):
  from tokenizers import Tokenizer, models, pre_tokenizers
  specials = [bos, eos, "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
  vocab = {t: i for i, t in enumerate(["<unk>"] + specials + list("abcdefghijklmnopqrstuvwxyz0123456789?"))}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(specials)
  tok.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(
      chat_template=template, bos_token=bos, eos_token=eos, tokenizer_class="PreTrainedTokenizerFast")))
  return tmp_path


def test_hf_template_raise_exception(tmp_path):
  d = _tiny_tokenizer_dir(tmp_path, "{{ raise_exception('only user turns') }}", "<s>", "</s>")
  with pytest.raises(Exception, match="only user turns"):
    data.render_prompt(data.Problem("1", "q", "a"), "hf", chat_template=data.load_chat_template(str(d)))


def test_jsonl_shapes_and_errors(tmp_path):
  f = tmp_path / "mix.jsonl"
  rows = [{"id": "p", "prompt": "1+1?", "answer": "2"},
          {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U?"}], "answer": "3"},
          {"question": "Clips?", "answer": "48 + 24 = 72\n#### 1,072"},
          {"problem": "Half?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}]
  f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  ps = data.load_jsonl(str(f))
  assert [(p.prompt, p.answer) for p in ps] == [("1+1?", "2"), ("U?", "3"), ("Clips?", "1072"), ("Half?", "\\frac{1}{2}")]
  assert ps[1].messages == (("system", "S"), ("user", "U?")) and ps[2].id == "L3" and ps[3].source == f"{f}:4"
  assert data.verify(ps[2], "so \\boxed{1072}") == 1.0
  for bad, msg in [({"foo": 1}, ":1: unknown record shape"), ({"question": "q", "answer": "no final"}, ":1: field 'answer' has no GSM8K"),
                   ({"problem": "q", "solution": "none"}, ":1: field 'solution' has no"),
                   ({"messages": [{"role": "assistant", "content": "x"}], "answer": "1"}, ":1: field 'messages' must end with a user turn")]:
    f.write_text(json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=msg):
      data.load_jsonl(str(f))
  f.write_text(json.dumps(rows[0]) + "\n")
  with pytest.raises(ValueError, match=":1: missing field 'question'"):
    data.load_jsonl(str(f), shape="gsm8k")


def test_fit_prompts_skips_and_reports(tmp_path, caplog):
  f = tmp_path / "long.jsonl"
  f.write_text("\n".join(json.dumps({"id": str(i), "prompt": "w " * n, "answer": "1"})
                         for i, n in enumerate([10, 300, 20])) + "\n")
  ps = data.load_jsonl(str(f))
  kept, skipped, longest = data.fit_prompts(ps, lambda p: p.prompt.split(), max_new_tokens=56, max_seq_len=256)
  assert [p.id for p in kept] == ["0", "2"] and longest == 20
  assert [(p.id, n) for p, n in skipped] == [("1", 300)]
  assert f"{f}:2" in caplog.text and "300 tokens > limit 200" in caplog.text


# Hand-labelled (predicted answer, reference, equal?) pairs of the kinds GSM8K and MATH produce; the prediction is
# scored as the completion "... \\boxed{pred}".
MATH_PAIRS = (
    ("\\frac{1}{2}", "0.5", 1), ("0.5", "\\frac12", 1), ("\\dfrac{3}{4}", "3/4", 1), ("0.33", "\\frac{1}{3}", 0),
    ("2\\sqrt{2}", "\\sqrt{8}", 1), ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", 1), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt2}{2}", 1),
    ("2\\pi", "2 \\pi", 1), ("\\pi/2", "\\frac{\\pi}{2}", 1), ("3.14", "\\pi", 0), ("6.28", "2\\pi", 0),
    ("(1, 3]", "(1,3]", 1), ("(1,3)", "[1,3]", 0), ("[2, \\infty)", "[2,\\infty)", 1), ("(-\\infty, 0)", "(-\\infty,0)", 1),
    ("\\{1, 2, 3\\}", "\\{3,2,1\\}", 1), ("\\{1,2\\}", "\\{1,2,3\\}", 0), ("1, 2, 3", "3, 2, 1", 1),
    ("5 \\text{ cm}", "5", 1), ("12\\text{ dollars}", "12", 1), ("\\$18", "18", 1), ("90^\\circ", "90", 1),
    ("25\\%", "25", 1), ("7 \\text{ cm}", "5", 0),
    ("\\text{(B)}", "\\text{(B)}", 1), ("B", "\\text{(B)}", 1), ("(C)", "\\text{(B)}", 0),
    ("18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18 dollars.\n#### 18", 1),
    ("72", "She has 48 + 24 = 72 clips.\n#### 72", 1), ("70", "48 + 24 = 72\n#### 72", 0),
    ("1,234", "1234", 1), ("-3", "-3.0", 1), ("3", "-3", 0), ("x = 5", "5", 1), ("y=2x+1", "2x+1", 1),
    ("x^2+2x+1", "(x+1)^2", 1), ("\\frac{x+1}{2}", "\\frac{1+x}{2}", 1), ("2x", "x^2", 0),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1),
    ("10^{3}", "1000", 1), ("1e3", "1000", 1), ("\\frac{10}{4}", "2.5", 1), ("5/2", "\\frac{5}{2}", 1),
    ("\\sqrt{3}", "1.732", 0), ("\\infty", "\\infty", 1), ("0.1", "\\frac{1}{10}", 1),
)


def test_math_verify_agrees_with_hand_labels():
  wrong = [(pred, ref, label) for pred, ref, label in MATH_PAIRS
           if data.verify(data.Problem("m", "?", ref), f"So the answer follows.\n\\boxed{{{pred}}}") != label]
  assert len(wrong) <= 0.1 * len(MATH_PAIRS), wrong
  p = data.Problem("g", "?", "#### 18")
  assert data.verify(p, "so \\boxed{18}") == 1.0 and data.verify(p, "18") == 0.0  # strict: unboxed scores 0
  assert data.verify(p, "The answer is 18", strict_math=False) == 1.0
