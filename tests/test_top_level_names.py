"""The checkout's root is the package ``flotilla``; on sys.path itself, its folders must not
shadow installed distributions of the same top-level name (Hugging Face's ``kernels``, which
transformers imports when it starts)."""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_kernels_from_the_checkout_root_gets_the_installed_distribution():
    # `python -c` puts the working directory first on sys.path, as `python -m pytest` does and as
    # Ray does for the workers of a driver started in the checkout.
    code = "import kernels, transformers.activations; print(kernels.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded_from = os.path.abspath(out.stdout.strip())
    assert "site-packages" in loaded_from and not loaded_from.startswith(os.path.join(REPO_ROOT, "kernels")), loaded_from


def test_flotilla_kernels_is_still_the_checkout_folder():
    import flotilla.kernels

    assert os.path.abspath(flotilla.kernels.__file__) == os.path.join(REPO_ROOT, "kernels", "__init__.py")
