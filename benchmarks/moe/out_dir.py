"""The --out-dir check the MoE benchmark scripts share: the folder is made (or refused) when the arguments are
parsed, so a long run never loses its result to a missing or read-only folder at the end."""

import os
import tempfile


def check_out_dir(ap, path):
    """Creates `path` if needed and writes and removes a file there (os.access says yes to root on any folder);
    a failure is the parser's error naming the folder and the fix."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        ap.error(f"--out-dir {path}: {e.strerror}; give a folder that can be created or written")
    try:
        with tempfile.NamedTemporaryFile(dir=path):
            pass
    except OSError as e:
        ap.error(f"--out-dir {path}: cannot write there ({e.strerror}); give a folder that can be written")
