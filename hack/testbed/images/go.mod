// Tiny static programs packed into OCI images for the real kubelet node (real-node.sh): the pod
// sandbox's pause process and an HTTP echo server for tests. Standard library only.
module arl.dev/tangram/testbed/images

go 1.26
