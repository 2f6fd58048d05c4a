"""The README says what is true: the tests it cites exist, its commands (and those of examples/README.md) name
files and flags that exist, and the tags that mark distribution-only lines come from the list it gives."""
import ast, glob, os, re, shutil, subprocess, sys
import pytest
import torch
from helpers import DATA, HERE, copy_set, fashion_resnet

SCRIPTS = ("scratch_lenet", "scratch_ring", "dp_resnet", "ddp_toy", "ddp_resnet", "fsdp_resnet", "diloco_resnet",
           "ft_ddp_resnet")
# The tag of each script's distribution-only lines; the README lists the same.
TAGS = {"scratch_ring": "RING", "dp_resnet": "DP", "ddp_toy": "DDP", "ddp_resnet": "DDP", "fsdp_resnet": "FSDP",
        "diloco_resnet": "DiLoCo", "ft_ddp_resnet": "FT"}
TAG = re.compile(r"(?<!`)#\s*([A-Z]{2,}[\w ]*?|DiLoCo):\s")   # "# DDP: ..."; not "`# DDP:`" in prose
COMMUNICATES = re.compile(r"\bdist\.(?!get_backend)\w+\(|fully_shard\(|\bDDP\(|"
                          r"nn\.DataParallel\(|dcp\.(save|load)\(")

def readme_commands():
    """(script, arguments, launched by torchrun) for every command in the code blocks of README.md and of
    examples/README.md, which it links."""
    text = open(os.path.join(HERE, "README.md")).read() + open(os.path.join(HERE, "examples", "README.md")).read()
    blocks = text.split("```")[1::2]
    for line in (l.split(" #")[0].strip() for block in blocks for l in block.splitlines()[1:]):
        words = next((part for part in line.split(";") if ".py" in part), line).split()   # a shell loop's command
        scripts = [i for i, w in enumerate(words) if w.endswith((".py", ".sbatch", ".sh"))]
        if scripts:
            i = scripts[-1]   # the script torchrun, sbatch or simulated_cluster.py runs
            yield words[i], words[i + 1:], "torchrun" in words[:i]


def test_readme_cites_only_tests_that_exist():
    """README.md links tests/README.md, which says what each test proves."""
    cited = set(re.findall(r"`(test_\w+)`", open(os.path.join(HERE, "tests", "README.md")).read()))
    assert "tests/README.md" in open(os.path.join(HERE, "README.md")).read()
    files = glob.glob(os.path.join(HERE, "test_*.py")) + glob.glob(os.path.join(HERE, "tests", "test_*.py"))
    defined = {name for path in files
               for name in re.findall(r"^def (test_\w+)", open(path).read(), re.M)}
    assert cited and cited <= defined, cited - defined


def test_readme_commands_name_files_and_flags_that_exist(monkeypatch, capsys):
    commands = list(readme_commands())
    assert len(commands) >= 10
    for script, argv, torchrun in commands:
        assert os.path.isfile(os.path.join(HERE, script)), script
        module = "ddp_resnet" if script.endswith(".sbatch") else os.path.splitext(script)[0]   # it runs ddp_resnet.py
        if module not in SCRIPTS:
            continue
        if torchrun or script.endswith(".sbatch"):   # how a script sees torchrun: flags valid only there
            monkeypatch.setenv("RANK", "0")
            monkeypatch.setenv("WORLD_SIZE", "2")
        else:
            monkeypatch.delenv("RANK", raising=False)
        try:
            __import__(module).parse_args(argv)
        except SystemExit:
            pytest.fail(f"README: {script} {' '.join(argv)}: {capsys.readouterr().err}")



def test_tags_come_from_the_readme_list_and_mark_every_collective():
    """Every tag in a script is its own (the README lists them), and every line that talks to
    the other ranks (a collective, the group, the wrapper) carries it."""
    readme = open(os.path.join(HERE, "README.md")).read()
    for tag in set(TAGS.values()):
        assert f"`# {tag}:`" in readme, tag
    for script in SCRIPTS:
        for number, line in enumerate(open(os.path.join(HERE, f"{script}.py")), 1):
            tags = TAG.findall(line)
            where = f"{script}.py:{number}: {line.strip()}"
            assert all(tag == TAGS.get(script) for tag in tags), where
            code = line.split("#")[0]
            communicates = COMMUNICATES.search(code) and not code.lstrip().startswith(("def ", "import", "from"))
            if script in TAGS and communicates:
                assert tags, f"untagged: {where}"


def test_the_readme_prediction_runs_beside_common_py(tmp_path):
    """The README's snippet, run in a folder of its own that holds common.py, a model.pt and ./data."""
    text = open(os.path.join(HERE, "README.md")).read()
    snippet = next(block for block in text.split("```")[1::2] if "argmax" in block).removeprefix("python\n")
    (tmp_path / "runs" / "ddp_resnet").mkdir(parents=True)
    torch.save(fashion_resnet(0).state_dict(), tmp_path / "runs" / "ddp_resnet" / "model.pt")
    shutil.copy(os.path.join(HERE, "common.py"), tmp_path)
    os.symlink(DATA, tmp_path / "data")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("tensor([") == 2, result.stdout   # 8 predicted classes, 8 true ones


def torch_names(tree):
    """The local names bound to torch or one of its modules in a file, by its import lines."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names
                      if alias.name.split(".")[0] == "torch"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def torch_problems(path):
    """Private torch names and assignments into torch in one file, as "file:line: what"."""
    name, problems = os.path.basename(path), []
    tree = ast.parse(open(path).read())
    torch_bound = torch_names(tree)
    def chain(node):   # ["torch", "distributed", "_x"] for an attribute chain rooted at a name
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        return [node.id] + parts[::-1] if isinstance(node, ast.Name) else []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            private = [p for p in node.module.split(".") + [a.name for a in node.names] if p.startswith("_")]
            if private:
                problems.append(f"{name}:{node.lineno}: from {node.module} import {private}")
        parts = chain(node) if isinstance(node, ast.Attribute) else []
        if parts and parts[0] in torch_bound:
            if any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts[1:]):
                problems.append(f"{name}:{node.lineno}: {'.'.join(parts)}")
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                parts = chain(target) if isinstance(target, ast.Attribute) else []
                if parts and ((parts[0] in torch_bound and parts[:2] != ["torch", "backends"])
                              or parts[-1] in torch_bound):   # torch's objects, or a module's `dist` replaced
                    problems.append(f"{name}:{node.lineno}: assigns {'.'.join(parts)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and (
                (chain(node.args[0]) or [""])[0] in torch_bound):
            problems.append(f"{name}:{node.lineno}: setattr on {'.'.join(chain(node.args[0]))}")
    return problems


def test_what_the_scripts_import_uses_torch_only_through_public_names_and_patches_nothing():
    """In every file a script is copied with: no torch name that starts with an underscore (the
    private API, which a release may rename), and no assignment into torch or a torch object
    bound by import, nor of a name that torch is imported as (monkeypatching). One kind of
    assignment is torch's documented interface: the switches of torch.backends (cudnn.allow_tf32),
    properties that call into torch."""
    files = sorted({name for script in SCRIPTS for name in copy_set(script)})
    assert files == ["common", "ddp_resnet", "ddp_toy", "diloco_resnet", "dp_resnet", "fsdp_resnet", "ft_ddp_resnet",
                     "scratch_lenet", "scratch_ring"]
    assert [p for name in files for p in torch_problems(os.path.join(HERE, name + ".py"))] == []
