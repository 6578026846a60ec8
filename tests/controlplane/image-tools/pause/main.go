// Command pause is a pod sandbox's one process: it holds the pod's namespaces and waits to be told to
// stop. Kubernetes' own (registry.k8s.io/pause) is a registry image, and no registry is reachable here.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	<-stop
}
