from setuptools import find_packages, setup

setup(
    name="fabriclab",
    version="0.1.0",
    description="Packet-level emulation lab for AI-datacenter networking",
    python_requires=">=3.10",
    packages=find_packages(include=["lab", "lab.*", "topologies", "topologies.*",
                                    "controllers", "controllers.*", "traffic", "traffic.*"]),
    package_data={"traffic": ["wireshark/*.lua"]},
    # mininet is the distribution's package (python3 module + mnexec), seen
    # through the venv's --system-site-packages; see vagrant/provision.sh.
    install_requires=[
        "os-ken>=4.2",
        "scapy>=2.6",
        "numpy>=1.24",
        "iperf3>=0.1.11",
        "matplotlib>=3.6",
        "PyYAML>=5.4",          # training-job's job files
    ],
    extras_require={"test": ["pytest>=7"]},
    entry_points={"console_scripts": ["fabriclab = lab.cli:main"],
                  "pytest11": ["fabriclab = lab.pytest_plugin"]},   # the fabric_lab fixture
)
