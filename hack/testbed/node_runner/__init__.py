"""The kubelet of the test bed's simulated nodes.

Registers the nodes listed in a YAML file (capacity, labels), keeps them Ready the way a kubelet does
(a Lease renewed every 10 s in kube-node-lease, the node status refreshed every minute), and runs the
pods bound to them as local processes:

- each pod gets its own local address reported as status.podIP: from --pod-cidr, added to `lo` while
  the pod holds it (--address-device lo; a 198.18.X.0/24 by default, as EndpointSlices refuse
  loopback addresses), or a 127.A.B.0/24 address where adding addresses is not allowed; containers
  share the host's network namespace, so a server must bind its pod IP (downward API status.podIP),
  as with hostNetwork pods sharing one node;
- command/args/env with kubelet's $(VAR) expansion, env from the downward API (fieldRef,
  resourceFieldRef), ConfigMaps and Secrets (valueFrom and envFrom);
- emptyDir, configMap, secret, downwardAPI, hostPath and projected volumes (the service-account token
  comes from the TokenRequest API, so in-cluster clients work: KUBERNETES_SERVICE_HOST/PORT point at
  the API server);
- init containers in order, readiness/liveness/startup probes (httpGet, tcpSocket, exec), restartPolicy
  with restartCount and a crash-loop back-off, exit codes and reasons in containerStatuses, the pod
  phase and conditions a kubelet reports;
- graceful deletion: SIGTERM to the container's process group, SIGKILL after the grace period, then
  the final delete with grace 0 (uid precondition), as a kubelet does.

Each container runs under bubblewrap when it is installed (own PID/IPC/UTS namespaces, read-only host
filesystem, a writable /tmp per pod, volumes bound at their mount paths, a container's default
capability set) and dies with the runner. A container's CPU limit becomes the CPU affinity of all its
processes, changed in place by a pod resize, which is reported as a kubelet reports it (resize.py).
runAsUser/runAsGroup, runAsNonRoot and readOnlyRootFilesystem are honoured under bubblewrap. Not
enforced: memory limits, seccomp profiles, images (there is no image: a container needs a command, or
an entry in --entrypoints mapping its image to one).

The package, module by module. Pure (unit-tested without a cluster): `podspec` ($(VAR) expansion,
quantities, the downward API, a container's environment and command line), `lifecycle` (restart
policy, crash-loop back-off, phase, readiness), `status` (the kubelet's conditions and status object),
`probes` (thresholds, and the three probe actions), `isolation` (the bubblewrap command line, users),
`resize` (in-place resize: cores, fit, conditions, and the affinity of a process tree). With side
effects: `volumes`, `network` (pod IPs), `processes` (start and stop), `podapi` (one pod's API calls),
`container` (one container's state), `worker` (one thread per pod: the state machine that uses all the
above), `node` (registration, heartbeats, the pod watch), `kubelet_api` (container logs for
`kubectl logs`) and `cli`. Run it as `python -m node_runner` with this package's parent directory on
PYTHONPATH (cluster-up.sh does).
"""
