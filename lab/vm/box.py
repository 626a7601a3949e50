"""A Vagrant box (libvirt provider) made from the lab VM's image, so that the README's
Vagrant path (`vagrant up`, then `make demo` in the guest) runs on a machine with no
box downloads: bench/vagrant_up.py uses it.

The lab VM boots its own busybox init with no network and no sshd; a Vagrant guest
needs systemd, sshd, DHCP on its first NIC, a `vagrant` user holding Vagrant's
insecure public key (from the host's vagrant package) with password-less sudo, and a
kernel and initrd the box can name. So the box is a copy of the image's root
filesystem (already provisioned by vagrant/provision.sh: the guest's provisioning
finds every package and the virtualenv in place and needs no network) with those
added from Debian's packages in a chroot, as a qcow2 disk without a partition table,
booted by vagrant-libvirt's direct kernel boot (the box's Vagrantfile names its
kernel and initrd, root=/dev/vda). Cached per lab VM image, like the image itself.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from lab.core.errors import LabError
from lab.vm import image

log = logging.getLogger(__name__)

NAME = "fabriclab-local"                 # what FABRICLAB_VAGRANT_BOX names
PACKAGES = ["linux-image-amd64", "initramfs-tools", "systemd-sysv", "openssh-server",
            "sudo", "rsync"]
DISK_GB = 16                             # the guest's disk (qcow2: grows as it is written)
INSECURE_KEY = Path("/usr/share/rubygems-integration/all/gems")   # vagrant-*/keys/vagrant.pub

# Merged under the project's Vagrantfile (which sets CPUs, memory, the synced folder):
# boot the box's own kernel; the libvirt driver is chosen by bench/vagrant_up.py
# (qemu, a software CPU, where /dev/kvm is missing).
BOX_VAGRANTFILE = """\
# the fabriclab-local box (lab/vm/box.py): its kernel, booted directly
Vagrant.configure("2") do |config|
  config.vm.provider :libvirt do |lv|
    lv.kernel = File.join(File.dirname(__FILE__), "vmlinuz")
    lv.initrd = File.join(File.dirname(__FILE__), "initrd.img")
    lv.cmd_line = "root=/dev/vda rw console=ttyS0 net.ifnames=0"
    lv.driver = ENV.fetch("FABRICLAB_LIBVIRT_DRIVER", "kvm")
  end
end
"""

NETWORK = "[Match]\nName=eth0\n\n[Network]\nDHCP=ipv4\n"


def insecure_public_key() -> Path:
    found = sorted(INSECURE_KEY.glob("vagrant-*/keys/vagrant.pub"))
    if not found:
        raise LabError("Vagrant's insecure public key was not found (Debian: apt-get "
                       "install vagrant)")
    return found[-1]


def metadata(disk_bytes: int) -> dict:
    """The libvirt box's metadata.json: provider, disk format, disk size in GB."""
    return {"provider": "libvirt", "format": "qcow2",
            "virtual_size": -(-disk_bytes // 2**30)}


def ensure(rebuild: bool = False) -> Path:
    """The box file for the current lab VM image: cached, or built now."""
    img = image.ensure()
    out = image.CACHE / "vagrant-box" / img.dir.name
    box = out / f"{NAME}.box"
    if box.exists() and not rebuild:
        return box
    work = out.with_name(out.name + ".tmp")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    p = image.Progress(work / "build.log")
    p.say(f"building the Vagrant box {NAME} from {img.dir.name}; log: {out}/build.log")
    disk = work / "root.ext4"
    p.phase("copying the image's root filesystem")
    p.run(["cp", "--sparse=always", str(img.rootfs), str(disk)], "cp rootfs")
    with open(disk, "r+b") as f:
        f.truncate(DISK_GB * 2**30)
    p.run(["e2fsck", "-fy", str(disk)], "e2fsck")
    p.run(["resize2fs", str(disk)], "resize2fs")
    p.phase(f"Debian's {', '.join(PACKAGES)} and the vagrant user, in a chroot")
    _chroot_setup(disk, work, p)
    p.phase("qcow2 disk, metadata, box")
    p.run(["qemu-img", "convert", "-O", "qcow2", str(disk), str(work / "box.img")],
          "qemu-img convert")
    disk.unlink()
    (work / "metadata.json").write_text(json.dumps(metadata(DISK_GB * 2**30)))
    (work / "Vagrantfile").write_text(BOX_VAGRANTFILE)
    p.run(["tar", "-C", str(work), "-cf", str(work / f"{NAME}.box"), "metadata.json",
           "Vagrantfile", "box.img", "vmlinuz", "initrd.img"], "tar")
    for f in ["box.img", "vmlinuz", "initrd.img"]:
        (work / f).unlink()
    took = p.close()
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    log.info(f"[vm] box {box} ({image._du(box)}) built in {took:.0f} s")
    return box


def _chroot_setup(disk: Path, work: Path, p: image.Progress) -> None:
    root = work / "root"
    root.mkdir()
    key = insecure_public_key().read_text().strip()
    (work / "network").write_text(NETWORK)
    env = "env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 " \
          "DEBIAN_FRONTEND=noninteractive"
    # a private mount namespace: every mount goes with it, whatever fails
    script = f"""set -e
mount -o loop '{disk}' '{root}'
mount -t proc proc '{root}/proc'
mount -t sysfs sys '{root}/sys'
mount --rbind /dev '{root}/dev'
cp /etc/resolv.conf '{root}/etc/resolv.conf'
printf '#!/bin/sh\\nexit 101\\n' > '{root}/usr/sbin/policy-rc.d'
chmod 755 '{root}/usr/sbin/policy-rc.d'
chroot '{root}' {env} apt-get update -q
chroot '{root}' {env} apt-get install -y -q --no-install-recommends {' '.join(PACKAGES)}
rm -f '{root}/usr/sbin/policy-rc.d'
chroot '{root}' useradd -m -s /bin/bash vagrant
mkdir -p '{root}/home/vagrant/.ssh'
echo '{key}' > '{root}/home/vagrant/.ssh/authorized_keys'
chmod 700 '{root}/home/vagrant/.ssh'; chmod 600 '{root}/home/vagrant/.ssh/authorized_keys'
chroot '{root}' chown -R vagrant:vagrant /home/vagrant/.ssh
echo 'vagrant ALL=(ALL) NOPASSWD:ALL' > '{root}/etc/sudoers.d/vagrant'
chmod 440 '{root}/etc/sudoers.d/vagrant'
echo 'UseDNS no' > '{root}/etc/ssh/sshd_config.d/vagrant.conf'
cp '{work}/network' '{root}/etc/systemd/network/80-eth0.network'
chroot '{root}' systemctl enable systemd-networkd ssh
echo fabriclab > '{root}/etc/hostname'
printf '127.0.0.1\\tlocalhost\\n127.0.1.1\\tfabriclab\\n' > '{root}/etc/hosts'
: > '{root}/etc/resolv.conf'
chroot '{root}' {env} apt-get clean
rm -rf '{root}'/var/lib/apt/lists/*
cp "$(ls '{root}'/boot/vmlinuz-* | sort -V | tail -1)" '{work}/vmlinuz'
cp "$(ls '{root}'/boot/initrd.img-* | sort -V | tail -1)" '{work}/initrd.img'
"""
    p.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
          "chroot setup")
