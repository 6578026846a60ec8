// Tools for the real nodes' images: imagetool writes a root filesystem as an OCI image (go-containerregistry),
// pause is the pod sandbox's process (the image registry.k8s.io/pause would be, were a registry reachable).
module unbroken.dev/tests/controlplane/image-tools

go 1.26.0

require github.com/google/go-containerregistry v0.22.1

require (
	github.com/klauspost/compress v1.19.2 // indirect
	github.com/opencontainers/go-digest v1.0.0 // indirect
	github.com/opencontainers/image-spec v1.1.1 // indirect
)
