"""The lab VM's image: a Debian kernel with its modules and a Debian root filesystem
provisioned by vagrant/provision.sh, built from Debian packages only.

    vmlinux      the kernel, uncompressed (decompressing vmlinuz under a software CPU
                 takes seconds at every boot)
    initrd.gz    busybox + the virtio, ext4 and 9p modules (lab/vm/guest/initrd-init)
    rootfs.ext4  debootstrap minbase bookworm + the lab's packages and virtualenv
                 (/opt/fabriclab/venv, an editable install of /fabriclab, where the
                 working tree is shared at run time)

Images are cached under a key of what goes into them (kernel package version,
provision.sh, setup.py and the top-level packages, this build code), so an image is
rebuilt only when one of those changes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import lzma
import os
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lab.core.errors import LabError
from lab.core.paths import VM_CACHE_DIR
from lab.vm import cpio

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
CACHE = VM_CACHE_DIR
SUITE = "bookworm"
TREE_IN_VM = "/fabriclab"               # the working tree's path inside the VM
VENV_IN_VM = "/opt/fabriclab/venv"      # as in the Vagrantfile: off the shared folder
# Bump when the image layout changes in a way the hashed files below do not show.
BUILD_FORMAT = 1
BUILD_CODE = ["lab/vm/image.py", "lab/vm/cpio.py", "lab/vm/guest/initrd-init"]
# On top of minbase and what provision.sh installs: what the guest init needs.
IMAGE_PACKAGES = ["kmod", "iproute2", "procps", "ca-certificates"]
# Installed after provision.sh, in its chroot (where no service starts): an ssh server,
# through which the cluster tier's head starts the other lab VM's worker.
SERVICE_PACKAGES = ["openssh-server"]
# Modules the initramfs loads to reach the disk and the shared tree (deps added).
INITRD_MODULES = ["virtio_pci", "virtio_blk", "ext4", "9pnet_virtio", "9p"]
KEEP_IMAGES = 2
HOST_TOOLS = {"qemu-system-x86_64": "qemu-system-x86", "debootstrap": "debootstrap",
              "mkfs.ext4": "e2fsprogs", "unshare": "util-linux", "depmod": "kmod"}


# --- what the image is made of ---------------------------------------------------------
@dataclass(frozen=True)
class ImageInputs:
    kernel_package: str       # e.g. linux-image-6.1.0-57-amd64
    kernel_version: str       # the Debian package version, e.g. 6.1.192-3
    provision_sha256: str     # vagrant/provision.sh
    python_sha256: str        # setup.py + the top-level packages (what the editable install maps)
    build_code_sha256: str    # BUILD_CODE files + BUILD_FORMAT

    @property
    def key(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return f"{SUITE}-{self.kernel_package.removeprefix('linux-image-')}-{digest[:12]}"

    @property
    def kernel_release(self) -> str:   # uname -r in the VM, the modules' directory
        return self.kernel_package.removeprefix("linux-image-")


def _sha256(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(hashlib.sha256(c).digest())
    return h.hexdigest()


def top_level_packages(repo: Path = REPO) -> list[str]:
    return sorted(p.parent.name for p in repo.glob("*/__init__.py"))


def inputs(repo: Path = REPO) -> ImageInputs:
    pkg, version = kernel_package()
    return ImageInputs(
        kernel_package=pkg, kernel_version=version,
        provision_sha256=_sha256((repo / "vagrant/provision.sh").read_bytes()),
        python_sha256=_sha256((repo / "setup.py").read_bytes(),
                              "\n".join(top_level_packages(repo)).encode()),
        build_code_sha256=_sha256(str(BUILD_FORMAT).encode(),
                                  *[(repo / f).read_bytes() for f in BUILD_CODE]))


def _out(args: list[str]) -> str:
    r = subprocess.run(args, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else ""


def kernel_package() -> tuple[str, str]:
    """The kernel package linux-image-amd64 points at, and its version (host apt lists)."""
    deps = _out(["apt-cache", "depends", "linux-image-amd64"])
    m = re.search(r"Depends: (linux-image-[0-9][^\s]*)", deps)
    if not m:
        raise LabError("apt does not know linux-image-amd64: run 'apt-get update' (the lab "
                       "VM's kernel comes from this host's Debian bookworm apt sources)")
    policy = _out(["apt-cache", "policy", m.group(1)])
    v = re.search(r"Candidate: (\S+)", policy)
    return m.group(1), v.group(1) if v else "unknown"


def bookworm_repositories() -> list[tuple[str, str, str]]:
    """(uri, suite, component) of this host's Debian bookworm apt sources."""
    out = _out(["apt-get", "indextargets", "--format", "$(REPO_URI) $(RELEASE) $(COMPONENT)",
                "Identifier: Packages"])
    repos = []
    for line in out.splitlines():
        uri, suite, component = line.split()
        if suite.split("-")[0] == SUITE and (uri, suite, component) not in repos:
            repos.append((uri, suite, component))
    if not any(suite == SUITE for _, suite, _ in repos):
        raise LabError(f"this host has no Debian {SUITE} apt source (with its lists fetched: "
                       f"run 'apt-get update'); the lab VM is built from Debian packages")
    return repos


# --- the cache --------------------------------------------------------------------------
@dataclass
class Image:
    dir: Path

    @property
    def vmlinux(self) -> Path:
        return self.dir / "vmlinux"

    @property
    def initrd(self) -> Path:
        return self.dir / "initrd.gz"

    @property
    def rootfs(self) -> Path:
        return self.dir / "rootfs.ext4"

    @property
    def ready(self) -> bool:
        return (self.dir / "READY").exists()

    def describe(self) -> dict:
        return json.loads((self.dir / "inputs.json").read_text())


def cached(ins: ImageInputs) -> Image:
    return Image(CACHE / ins.key)


def _prune(keep: Path) -> None:
    """Keep the newest KEEP_IMAGES images (this one included): each is ~1 GB of disk.
    Called holding the build lock, so any *.tmp left is a failed build's."""
    for d in CACHE.glob("*.tmp"):
        shutil.rmtree(d, ignore_errors=True)
    images = sorted((d for d in CACHE.iterdir() if (d / "READY").exists() and d != keep),
                    key=lambda d: (d / "READY").stat().st_mtime, reverse=True)
    for d in images[KEEP_IMAGES - 1:]:
        shutil.rmtree(d, ignore_errors=True)


# --- progress ---------------------------------------------------------------------------
class Progress:
    """One line per phase with the elapsed time (logged, and in build.log with the
    details)."""

    def __init__(self, log_path: Path):
        self.t0 = time.monotonic()
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.phase_t0 = self.t0

    def phase(self, text: str) -> None:
        self.phase_t0 = time.monotonic()
        self.say(text)

    def say(self, text: str) -> None:
        line = f"[vm build {time.monotonic() - self.t0:6.1f} s] {text}"
        log.info(line)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, args: list[str], what: str, echo_prefix: str | None = None, **kw) -> None:
        """Run a build step, its output into the log (lines starting with echo_prefix
        also on the terminal); on failure, raise with the log's tail."""
        self.log.write(f"$ {' '.join(map(str, args))}\n")
        self.log.flush()
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", **kw)
        tail: list[str] = []
        for line in proc.stdout:
            self.log.write(line)
            tail = (tail + [line.rstrip()])[-15:]
            if echo_prefix and line.startswith(echo_prefix):
                self.say("  " + line.rstrip())
        self.log.flush()
        if proc.wait():
            raise LabError(f"building the lab VM image failed at: {what} (exit "
                           f"{proc.returncode}); last lines of {self.log_path}:\n  "
                           + "\n  ".join(tail))

    def close(self) -> float:
        self.log.close()
        return time.monotonic() - self.t0


# --- the build --------------------------------------------------------------------------
def ensure_host_tools() -> None:
    """Install the host tools the VM needs (qemu, debootstrap, ...) when missing."""
    missing = sorted({pkg for tool, pkg in HOST_TOOLS.items() if not shutil.which(tool)})
    if not missing:
        return
    if os.geteuid() != 0:
        raise LabError(f"the lab VM needs {', '.join(missing)}: run as root (sudo) or "
                       f"'apt-get install {' '.join(missing)}'")
    log.info(f"[vm] installing host tools for the lab VM: {' '.join(missing)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                       env=env, capture_output=True, text=True)
    if r.returncode:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        r = subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends",
                            *missing], env=env, capture_output=True, text=True)
    if r.returncode:
        raise LabError(f"could not install {' '.join(missing)}: "
                       f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")


def ensure(rebuild: bool = False) -> Image:
    """The image for the current inputs: cached, or built now."""
    if os.geteuid() != 0:
        raise LabError("the lab VM needs root (debootstrap, chroot, qemu): run with sudo")
    ensure_host_tools()
    ins = inputs()
    img = cached(ins)
    if img.ready and not rebuild:
        return img
    CACHE.mkdir(parents=True, exist_ok=True)
    import fcntl
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # a concurrent build of the same image waits
        if img.ready and not rebuild:
            return img
        build(ins, img.dir)
    _prune(img.dir)
    return img


def build(ins: ImageInputs, dest: Path) -> None:
    work = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    p = Progress(work / "build.log")
    p.say(f"building the lab VM image {ins.key} ({ins.kernel_package} {ins.kernel_version}, "
          f"Debian {SUITE} minbase + vagrant/provision.sh); log: {dest}/build.log")
    root = work / "rootfs"
    try:
        debs = _download(ins, work, p)
        _debootstrap(root, p)
        _provision(root, p)
        _install_kernel(ins, debs["kernel"], root, work, p)
        _configure(root, p)
        _initramfs(ins, debs["busybox"], root, work, p)
        _filesystem(root, work, p)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(work / "debs", ignore_errors=True)
    (work / "inputs.json").write_text(json.dumps({**asdict(ins), "key": ins.key}, indent=1))
    total = p.close()
    shutil.rmtree(dest, ignore_errors=True)
    work.rename(dest)
    (dest / "READY").write_text(f"built in {total:.0f} s\n")
    log.info(f"[vm build {total:6.1f} s] image ready: {dest}")


def _download(ins: ImageInputs, work: Path, p: Progress) -> dict[str, Path]:
    p.phase(f"downloading {ins.kernel_package} and busybox-static")
    debs = work / "debs"
    debs.mkdir()
    p.run(["apt-get", "download", ins.kernel_package, "busybox-static"], "apt-get download",
          cwd=debs)
    return {"kernel": next(debs.glob(f"{ins.kernel_package}_*.deb")),
            "busybox": next(debs.glob("busybox-static_*.deb"))}


def _debootstrap(root: Path, p: Progress) -> None:
    repos = bookworm_repositories()
    mirror = next(uri for uri, suite, _ in repos if suite == SUITE)
    p.phase(f"debootstrap --variant=minbase {SUITE} from {mirror}")
    debs = CACHE / "debootstrap-debs"   # survives between builds: saves the downloads
    debs.mkdir(parents=True, exist_ok=True)
    p.run(["debootstrap", "--variant=minbase", f"--include={','.join(IMAGE_PACKAGES)}",
           f"--cache-dir={debs}", SUITE, str(root), mirror], "debootstrap")
    # the host's bookworm sources (updates, security), so provision.sh gets the same packages
    (root / "etc/apt/sources.list").write_text("".join(
        f"deb {uri} {suite} {component}\n" for uri, suite, component in repos))
    p.say(f"  root filesystem: {_du(root)}")


# --- provisioning in a chroot -----------------------------------------------------------
BUILD_DIR_IN_ROOT = "/tmp/fabriclab-build"
APT_SETTINGS = re.compile(r"proxy|Check-Valid-Until|Check-Date|CaInfo|Verify-Peer", re.I)
PIP_CONFIGS = ["/etc/pip.conf", "/etc/xdg/pip", "/root/.config/pip/pip.conf",
               "/root/.pip/pip.conf"]


@dataclass
class HostPackageConfig:
    """What of this host's package configuration the build borrows to reach the same
    archives and indexes (proxies, local wheel directories, a TLS-inspecting CA), and
    removes again: none of it stays in the image."""
    files: list[str]           # copied into the root at the same path
    dirs: list[str]            # bind-mounted read-only at the same path
    env: dict[str, str]


def _referenced_paths(text: str) -> list[str]:
    return sorted({m.rstrip("/") for m in re.findall(r"(?:file://)?(/[^\s\"';,]+)", text)})


def host_package_config() -> HostPackageConfig:
    files: list[str] = []
    for c in PIP_CONFIGS + [os.environ.get("PIP_CONFIG_FILE", "")]:
        path = Path(c) if c else None
        if path and path.is_dir():
            files += [str(f) for f in path.iterdir() if f.is_file()]
        elif path and path.is_file():
            files.append(str(path))
    files += [str(f) for f in Path("/etc/apt/apt.conf.d").glob("*")
              if f.is_file() and APT_SETTINGS.search(f.read_text(errors="replace"))
              and "Invoke" not in f.read_text(errors="replace")]   # settings, never hooks
    env = {k: v for k, v in os.environ.items()
           if k.startswith("PIP_") or k.lower().endswith("_proxy")}
    text = "\n".join(Path(f).read_text(errors="replace") for f in files) + \
        "\n".join(v for k, v in env.items() if k.startswith("PIP_"))
    dirs = []
    for path in _referenced_paths(text):
        if path.startswith("/etc/ssl/"):
            continue   # the CA bundle is handed over through PIP_CERT below
        if Path(path).is_file() and path not in files:
            files.append(path)
        elif Path(path).is_dir() and not path.startswith(("/etc", "/usr", "/var")):
            # a PEP 503 file index keeps its files next to simple/, not in it
            dirs.append(str(Path(path).parent) if Path(path).name == "simple" else path)
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if bundle.exists():
        ca = f"{BUILD_DIR_IN_ROOT}/ca-certificates.crt"
        env.update(PIP_CERT=ca, SSL_CERT_FILE=ca, REQUESTS_CA_BUNDLE=ca)
    return HostPackageConfig(files=files, dirs=dirs, env=env)


def _snapshot_tree(dest: Path) -> None:
    """The working tree's files (tracked and untracked, not ignored) for the editable install."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _provision(root: Path, p: Progress) -> None:
    p.phase("vagrant/provision.sh in the image (packages, virtualenv, editable install)")
    cfg = host_package_config()
    tree = root / TREE_IN_VM.lstrip("/")
    tree.mkdir(parents=True, exist_ok=True)
    _snapshot_tree(tree)
    build_dir = root / BUILD_DIR_IN_ROOT.lstrip("/")
    build_dir.mkdir(parents=True, exist_ok=True)
    if "PIP_CERT" in cfg.env:
        shutil.copy("/etc/ssl/certs/ca-certificates.crt", build_dir / "ca-certificates.crt")
    borrowed = []
    for f in cfg.files:
        target = root / f.lstrip("/")
        if not target.exists():   # never overwrite the image's own files
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(f, target)
            borrowed.append(target)
    shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
    # No service starts while packages install (the chroot is not a running system),
    # and no module loads into the host's kernel: modprobe is a no-op during the build.
    stubs = {root / "usr/sbin/policy-rc.d": "#!/bin/sh\nexit 101\n",
             root / "usr/local/sbin/modprobe": "#!/bin/sh\nexit 0\n"}
    for path, text in stubs.items():
        path.write_text(text)
        path.chmod(0o755)
    # The image runs the kernel tier: none of the suite's tools for reports and the
    # Vagrantfile (FABRICLAB_SUITE_TOOLS).
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root", "LANG": "C.UTF-8", "DEBIAN_FRONTEND": "noninteractive",
           "FABRICLAB_VENV": VENV_IN_VM, "FABRICLAB_DATAPATH": "user",
           "FABRICLAB_SUITE_TOOLS": "0", **cfg.env}
    envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    binds = "".join(f"mkdir -p '{root}{d}' && mount --bind -o ro '{d}' '{root}{d}'\n"
                    for d in cfg.dirs)
    # A private mount namespace (the mounts vanish with it) and a PID namespace: the
    # Open vSwitch that provision.sh starts in the chroot dies when provisioning ends.
    script = f"""set -e
mount -t proc proc '{root}/proc'
mount -t sysfs sys '{root}/sys'
mount --rbind /dev '{root}/dev'
{binds}chroot '{root}' /usr/bin/env -i {envs} bash {TREE_IN_VM}/vagrant/provision.sh {TREE_IN_VM}
chroot '{root}' /usr/bin/env -i {envs} apt-get install -y -q --no-install-recommends \
    {' '.join(SERVICE_PACKAGES)}
"""
    try:
        p.run(["unshare", "--pid", "--fork", "--kill-child", "--mount", "--propagation",
               "private", "sh", "-c", script], "vagrant/provision.sh", echo_prefix="[provision]")
    finally:
        for path in [*stubs, *borrowed]:
            path.unlink(missing_ok=True)
        shutil.rmtree(build_dir, ignore_errors=True)
    if not (root / VENV_IN_VM.lstrip("/") / "bin/fabriclab").exists():
        raise LabError(f"provision.sh finished but {VENV_IN_VM}/bin/fabriclab is missing; "
                       f"see {p.log_path}")
    # the tree is shared at run time; what stays is the empty mount point
    shutil.rmtree(tree)
    tree.mkdir()
    p.say(f"  provisioned: {_du(root)}")


# --- kernel, configuration, initramfs, filesystem ---------------------------------------
def _install_kernel(ins: ImageInputs, deb: Path, root: Path, work: Path, p: Progress) -> None:
    p.phase(f"kernel {ins.kernel_release}: modules into the image, vmlinux")
    x = work / "kernel"
    p.run(["dpkg-deb", "-x", str(deb), str(x)], "dpkg-deb -x kernel")
    modules = root / "usr/lib/modules"
    modules.mkdir(parents=True, exist_ok=True)
    # not dpkg-deb -x into the root: the package's /lib would replace bookworm's /lib link
    shutil.move(str(x / "lib/modules" / ins.kernel_release), str(modules))
    p.run(["depmod", "-b", str(root), ins.kernel_release], "depmod")
    vmlinuz = x / f"boot/vmlinuz-{ins.kernel_release}"
    (work / "vmlinux").write_bytes(extract_vmlinux(vmlinuz.read_bytes()))
    shutil.rmtree(x)


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage whose payload is xz (Debian's): qemu boots it
    directly, skipping the in-guest decompression."""
    start = bzimage.find(b"\xfd7zXZ\x00")
    if start < 0:
        raise LabError("the kernel image has no xz payload: cannot extract vmlinux")
    elf = lzma.LZMADecompressor().decompress(bzimage[start:])
    if not elf.startswith(b"\x7fELF"):
        raise LabError("the kernel's xz payload is not an ELF vmlinux")
    return elf


def _configure(root: Path, p: Progress) -> None:
    p.phase("configuring the image")
    (root / "etc/hostname").write_text("fabriclab-vm\n")
    (root / "etc/hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tfabriclab-vm\n"
                                    "::1\tlocalhost ip6-localhost ip6-loopback\n")
    (root / "etc/resolv.conf").write_text("")   # the VM has no network
    (root / "etc/fstab").write_text("/dev/vda / ext4 rw 0 0\n")
    # login shells (vm shell) see the venv as the Vagrant VM's users do
    (root / "etc/profile.d/fabriclab.sh").write_text(
        f"export FABRICLAB_VENV={VENV_IN_VM}\nexport PATH={VENV_IN_VM}/bin:$PATH\n"
        f"cd {TREE_IN_VM} 2>/dev/null\n")
    # Open vSwitch's database from the chroot run: the VM makes its own at first start
    for f in ["etc/openvswitch/conf.db", "etc/openvswitch/system-id.conf"]:
        (root / f).unlink(missing_ok=True)
    for d in ["var/lib/apt/lists", "var/cache/apt/archives", "tmp", "run", "var/log/openvswitch"]:
        _empty(root / d)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True, exist_ok=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


def _empty(d: Path) -> None:
    if d.is_dir():
        for child in d.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


def initrd_modules(root: Path, release: str) -> list[Path]:
    """The module files INITRD_MODULES need, dependencies first, each once."""
    out: list[Path] = []
    for name in INITRD_MODULES:
        deps = _out(["modprobe", "-d", str(root), "-S", release, "--show-depends", name])
        for line in deps.splitlines():
            if line.startswith("insmod "):
                path = Path(line.split()[1])
                if path not in out:
                    out.append(path)
    if not out:
        raise LabError(f"modprobe found none of {INITRD_MODULES} for {release} in {root}")
    return out


def _initramfs(ins: ImageInputs, busybox_deb: Path, root: Path, work: Path,
               p: Progress) -> None:
    p.phase("initramfs: busybox + virtio, ext4 and 9p modules")
    x = work / "busybox"
    p.run(["dpkg-deb", "-x", str(busybox_deb), str(x)], "dpkg-deb -x busybox")
    modules = initrd_modules(root, ins.kernel_release)
    entries = [cpio.directory(d) for d in ["bin", "dev", "proc", "sys", "newroot", "modules"]]
    entries += [cpio.file("bin/busybox", x / "bin/busybox", 0o755),
                cpio.file("init", REPO / "lab/vm/guest/initrd-init", 0o755)]
    entries += [cpio.file(f"modules/{m.name}", m) for m in modules]
    order = "".join(m.name + "\n" for m in modules).encode()
    entries.append(cpio.Entry("modules/order", 0o100644, order))
    cpio.write_gzip(work / "initrd.gz", entries)
    shutil.rmtree(x)


def _filesystem(root: Path, work: Path, p: Progress) -> None:
    p.phase("ext4 filesystem from the root directory (mkfs.ext4 -d)")
    used = int(_out(["du", "-sb", str(root)]).split()[0])
    size_mb = int(used * 1.3 / 2**20) + 2048   # room for what runs write (sparse file)
    img = work / "rootfs.ext4"
    with open(img, "wb") as f:
        f.truncate(size_mb * 2**20)
    p.run(["mkfs.ext4", "-q", "-F", "-L", "fabriclab-vm", "-d", str(root), str(img)],
          "mkfs.ext4")
    p.say(f"  rootfs.ext4: {size_mb} MB sparse, {_du(img)} used")


def _du(path: Path) -> str:
    return (_out(["du", "-sh", str(path)]).split() or ["?"])[0]
