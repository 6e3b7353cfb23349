"""Executes benchmarks/ragvit_benchmarks.ipynb headless and saves it with its outputs.

``python benchmarks/run_notebook.py`` renders it into build/notebook/ (the executed
notebook and its PNGs): in full mode on a machine with a CUDA GPU ragvit can use, in tiny
mode (a seconds-long CPU sweep, RAGVIT_NB_TINY=1) on one without; ``--tiny`` / ``--full``
force a mode, and RAGVIT_NB_TINY=1 in the environment is the same as --tiny. ``--out DIR``
writes elsewhere (RAGVIT_NB_FIGS: the PNGs go next to the notebook); tiny mode refuses
benchmarks/results, whose figures are measured ones. --results are the folders the notebook
loads results JSONs from (RAGVIT_NB_RESULTS, default benchmarks/results), --sweep makes it
also run its own sweep on this machine (RAGVIT_NB_SWEEP=1; on an H200 about two minutes).
The notebook prints paths relative to the repository, so the saved outputs name no folder
of the machine that ran it; --text-only drops the figures' inline images from the saved
notebook (the PNG files hold them), as the repository's copy keeps them.

Engine: nbclient with an ipykernel, as tests/test_bench.py runs it, when both import;
otherwise (e.g. a GPU host without Jupyter) an in-process runner: each code cell is exec'd
in one namespace, its stdout/stderr become stream outputs, every open matplotlib figure a
PNG display output (72 dpi: the full-size PNGs are the files in DIR), and the value of a
trailing expression an execute_result, so the saved notebook reads like a kernel's. Both
engines find ragvit in the repository (an in-place build) or installed.
The notebook is written with json (nbformat v4).
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NOTEBOOK = os.path.join(HERE, "ragvit_benchmarks.ipynb")
DEFAULT_OUT = os.path.join("build", "notebook")  # relative to the repository root
RESULTS = os.path.join(HERE, "results")


def gpu_problem() -> str | None:
    """Why full mode has no GPU here (None: torch sees one and ragvit has its kernels)."""
    if ROOT not in sys.path:  # the in-place build
        sys.path.insert(0, ROOT)
    try:
        import torch  # noqa: F401 - cuda_problem needs it

        from ragvit.bench.sweep import cuda_problem
    except ImportError as e:
        return f"torch or ragvit does not import ({e})"
    return cuda_problem()


def _lines(text: str) -> list[str]:
    parts = text.splitlines(keepends=True)
    return parts or [""]


def run_inprocess(nb: dict, cwd: str) -> None:
    """Executes nb's code cells in this process, filling their outputs (see the docstring)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "__main__"}
    old = os.getcwd()
    os.chdir(cwd)
    try:
        count = 0
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            count += 1
            source = "".join(cell["source"])
            out, err = io.StringIO(), io.StringIO()
            outputs, result, failure = [], None, None
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    tree = ast.parse(source)
                    last = tree.body[-1] if tree.body and isinstance(tree.body[-1], ast.Expr) \
                        else None
                    if last is not None:
                        tree.body = tree.body[:-1]
                    exec(compile(tree, f"<cell {count}>", "exec"), namespace)  # noqa: S102
                    if last is not None:
                        result = eval(compile(ast.Expression(last.value), f"<cell {count}>",
                                              "eval"), namespace)  # noqa: S307
            except Exception as e:  # noqa: BLE001 - recorded like a kernel error, then raised
                failure = e
            for name, stream in (("stdout", out), ("stderr", err)):
                if stream.getvalue():
                    outputs.append({"output_type": "stream", "name": name,
                                    "text": _lines(stream.getvalue())})
            for num in plt.get_fignums():
                buf = io.BytesIO()
                plt.figure(num).savefig(buf, format="png", dpi=72, bbox_inches="tight")
                outputs.append({"output_type": "display_data", "metadata": {}, "data": {
                    "image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                    "text/plain": [f"<Figure {num}>"]}})
            plt.close("all")
            if result is not None:
                outputs.append({"output_type": "execute_result", "execution_count": count,
                                "metadata": {}, "data": {"text/plain": _lines(repr(result))}})
            if failure is not None:
                tb = traceback.format_exception(failure)
                outputs.append({"output_type": "error", "ename": type(failure).__name__,
                                "evalue": str(failure), "traceback": tb})
            cell["outputs"], cell["execution_count"] = outputs, count
            if failure is not None:
                raise RuntimeError(f"cell {count} failed:\n{''.join(tb)}") from failure
    finally:
        os.chdir(old)


def drop_images(nb) -> None:
    """Removes the inline images of every output (their text/plain stays)."""
    for cell in nb["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data")
            if data:
                for key in [k for k in data if k.startswith("image/")]:
                    del data[key]


def run_nbclient(path: str, timeout: int):
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": HERE}})
    client.execute()
    return nb


def has_nbclient() -> bool:
    try:
        import ipykernel  # noqa: F401
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help=f"folder for the executed notebook and PNGs (default: "
                   f"{DEFAULT_OUT} in the repository)")
    p.add_argument("--results", nargs="+", help="results folders the notebook loads")
    p.add_argument("--sweep", action="store_true", help="also run the notebook's own sweep")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tiny", action="store_true",
                      help="CPU tiny mode (default without a GPU, or with RAGVIT_NB_TINY=1)")
    mode.add_argument("--full", action="store_true",
                      help="full mode (default with a GPU); on a CPU it plots stored results")
    p.add_argument("--engine", choices=("auto", "nbclient", "inprocess"), default="auto")
    p.add_argument("--timeout", type=int, default=600, help="nbclient: seconds per cell")
    p.add_argument("--text-only", action="store_true",
                   help="save the notebook without its inline images (the PNGs hold them)")
    args = p.parse_args(argv)
    if args.tiny or args.full:
        tiny, why = args.tiny, "--tiny" if args.tiny else "--full"
    elif os.environ.get("RAGVIT_NB_TINY") == "1":
        tiny, why = True, "RAGVIT_NB_TINY=1"
    else:
        problem = gpu_problem()
        tiny, why = problem is not None, f"no GPU: {problem}" if problem else "a GPU"
    out = os.path.abspath(args.out or os.path.join(ROOT, DEFAULT_OUT))
    if tiny and (os.path.realpath(out) + os.sep).startswith(os.path.realpath(RESULTS) + os.sep):
        p.error("--out: tiny mode writes no figures into benchmarks/results (its numbers are "
                "a CPU smoke run); pass --full to re-plot the stored results there")
    print(f"{'tiny' if tiny else 'full'} mode ({why})", flush=True)
    os.makedirs(out, exist_ok=True)
    root = ROOT
    os.environ.update(RAGVIT_NB_FIGS=out,
                      RAGVIT_NB_SWEEP="1" if args.sweep else "0",
                      RAGVIT_NB_TINY="1" if tiny else "0",
                      PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if args.results:
        os.environ["RAGVIT_NB_RESULTS"] = os.pathsep.join(os.path.abspath(r)
                                                          for r in args.results)
    engine = args.engine
    if engine == "auto":
        engine = "nbclient" if has_nbclient() else "inprocess"
    t0 = time.monotonic()
    if engine == "nbclient":
        nb = run_nbclient(NOTEBOOK, args.timeout)
        import nbformat

        if args.text_only:
            drop_images(nb)
        nbformat.write(nb, os.path.join(out, "ragvit_benchmarks.ipynb"))
    else:
        if root not in sys.path:  # the in-place build, as the kernel gets it from PYTHONPATH
            sys.path.insert(0, root)
        with open(NOTEBOOK) as f:
            nb = json.load(f)
        try:
            run_inprocess(nb, HERE)
        finally:
            if args.text_only:
                drop_images(nb)
            with open(os.path.join(out, "ragvit_benchmarks.ipynb"), "w") as f:
                json.dump(nb, f, indent=1, ensure_ascii=False)
                f.write("\n")
    pngs = sorted(f for f in os.listdir(out) if f.endswith(".png"))
    shown = args.out or DEFAULT_OUT
    print(f"executed with {engine} in {time.monotonic() - t0:.0f} s; wrote "
          f"{os.path.join(shown, 'ragvit_benchmarks.ipynb')} and {len(pngs)} PNGs: "
          f"{', '.join(pngs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
