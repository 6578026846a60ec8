// Command coredns is CoreDNS built with the plugins the real nodes' cluster DNS needs (bind, errors, log,
// kubernetes), from its Go module at the version go.mod pins: the build every Kubernetes distribution ships has
// dozens more, whose cloud SDKs would double the build for nothing the tests use.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
)

func init() {
	dnsserver.Directives = []string{"bind", "errors", "log", "kubernetes"} // the order a query meets them
}

func main() {
	coremain.Run()
}
