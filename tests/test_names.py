"""No top-level module of the project shadows a package the stack imports: run from the project directory (where
python puts it first on sys.path), `import kernels` must reach Hugging Face's package, not ours. The names to avoid
are every installed distribution's top-level packages and every optional package transformers probes for (its own
list: the `_is_package_available("NAME")` calls in transformers/utils/import_utils.py; `kernels` is one, imported by
transformers >= 5.25)."""
import importlib.metadata
import os
import re
import subprocess
import sys

import transformers.utils.import_utils

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_top_level_module_shadows_a_package_the_stack_imports():
  ours = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")}
  ours |= {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "__init__.py"))}
  probed = set(re.findall(r'_is_package_available\(\s*"([A-Za-z0-9_.]+)"',
                          open(transformers.utils.import_utils.__file__).read()))
  assert "kernels" in probed and len(probed) > 50  # the list is what it claims to be
  installed = set(importlib.metadata.packages_distributions())
  assert not ours & (probed | installed), sorted(ours & (probed | installed))


def test_transformers_model_classes_import_from_the_project_directory():
  r = subprocess.run([sys.executable, "-c", "from transformers import LlamaForCausalLM, Qwen2ForCausalLM, "
                      "Qwen3ForCausalLM; import kernels"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"))
  # `import kernels` from here must not find a project module: the HF package is not installed in this venv, so
  # the only acceptable outcome of that import is ModuleNotFoundError.
  assert "ModuleNotFoundError: No module named 'kernels'" in r.stderr, r.stderr[-2000:]
  assert "LlamaForCausalLM" not in r.stderr, r.stderr[-2000:]
